/**
 * The worker's zygote (docs/adr/0014-fncall.md): a Python script the edge
 * starts once per worker sandbox, as the sandbox's root, through chronus
 * (`python3 -c ZYGOTE_BOOT ZYGOTE_PY CONFIG`). Its stdin and stdout are the call channel,
 * one JSON object per line each way:
 *
 *   edge → zygote   {"id", "code", "stdin", "files", "args", "env", "timeoutMs",
 *                    "memoryMb", "maxOutputBytes", "nproc", "fsizeMb"}
 *   zygote → edge   {"t": "ready"}                  once, after its set-up
 *                   {"t": "started", "id"}          the call's process exists
 *                   {"t": "done", "id", "exitCode", "signal", "outcome", "stdout",
 *                    "stderr", "stdoutBytes", "stderrBytes", "truncated",
 *                    "durationMs", "leftover", "retire"}
 *
 * Per call it forks: the child drops to the call uid (no groups, no
 * capabilities), takes its rlimits (data segment for memory, NPROC, CPU,
 * FSIZE), gets a fresh empty work dir and HOME, and either runs the code in
 * the already-started interpreter (`mode: python`, the fast path) or execs
 * the runtime's command. After the call's main process ends, everything of
 * the call uid is killed (kill(-1) as that uid, until nothing is left; the
 * zygote is the subreaper, so every orphan is its child and is reaped), its
 * SysV IPC objects removed, and every place it could write emptied.
 *
 * No backticks or dollar-brace sequences may appear in the script.
 */
/**
 * What `python3 -c` runs: compiles the zygote (its first argument, taken off
 * `sys.argv`) and runs it. Given to `-c` itself, the script would run while
 * the parser's syntax tree of it, about 1.3 MB of the heap, stayed allocated
 * (python frees it when the `-c` code returns, and the zygote never does):
 * memory every call's fork copies into its page table and its exit tears
 * down. `compile` frees the tree before the zygote starts.
 */
export const ZYGOTE_BOOT = "import sys; exec(compile(sys.argv.pop(1), '<fncall-zygote>', 'exec'))";

export const ZYGOTE_PY = String.raw`
import builtins, errno, io, json, linecache, os, resource, select, shutil, signal, stat, sys, time, types, warnings

CONFIG = json.loads(sys.argv[1])
UID = CONFIG["uid"]
GID = CONFIG["uid"]
MODE = CONFIG["mode"]
WORK = "/fncall/work"
HOME = "/fncall/home"
# The only places the call uid may write; each is emptied after every call.
SCRATCH = ["/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue"]
ALLOWED_WRITABLE = set(SCRATCH) | {"/fncall/work", "/fncall/home"}
# What a watch on each of those reports (inotify(7)): an entry made, moved in or written, the
# directory's own mode or owner changed, the directory itself removed or moved.
IN_MODIFY, IN_ATTRIB, IN_MOVED_TO, IN_CREATE, IN_DELETE_SELF, IN_MOVE_SELF = 0x2, 0x4, 0x80, 0x100, 0x400, 0x800
WATCH_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_TO | IN_CREATE | IN_DELETE_SELF | IN_MOVE_SELF
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
PR_SET_CHILD_SUBREAPER = 36
# Every call's environment before its own; the zygote's own (set_base_env), which a call
# without env of its own inherits as it is.
BASE_ENV = dict(CONFIG["env"], HOME=HOME, PWD=WORK, TMPDIR="/tmp")
# Programs up to this many characters are compiled before the fork (prepare).
PRECOMPILE_MAX_CHARS = 65536

# random's after-fork reseed, done by the zygote before each fork instead (preload); None: none.
RESEED = None
RANDOM_HOOK = None
# The inotify instance watching the scratch places (watch_scratch); -1: none, clean after every call.
WATCH = -1
# The call channel, moved off fd 0 in main() (fd 0 then is what a call's stdin is: a memfd).
inp = None
CHANNEL_IN = -1
# Made once (main) and never used by the zygote itself, so every child finds them as new:
# the python fast path's sys.stdin, sys.stdout, sys.stderr and __main__ module.
STD = None
MAIN = None
# One JSON string as json.dumps(ensure_ascii=False) writes it (the C encoder, no Python layers).
json_str = json.encoder.encode_basestring


def write_all(data):
    # Straight to the fd: the buffered writer's layers cost more than the syscall.
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def send(obj):
    write_all(json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogateescape") + b"\n")


LIBC = None


def libc():
    """The C library, loaded once (the clean-up re-arms its inotify watches through it after every
    call that touched a scratch place: each exec runtime's call, which writes its program file)."""
    global LIBC
    if LIBC is None:
        import ctypes
        LIBC = ctypes.CDLL(None, use_errno=True)
    return LIBC


def seal_root():
    """Takes write permission for others away everywhere but the scratch places.

    The call uid owns nothing and is in no group, so world-writable
    directories and files are all it could write outside its own dirs.
    """
    root_dev = os.lstat("/").st_dev
    for top, dirs, files in os.walk("/", topdown=True):
        if top in ("/proc", "/sys", "/dev"):
            dirs[:] = []
            continue
        keep = []
        for name in dirs:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_dev != root_dev and path not in ("/tmp", "/var/tmp"):
                continue
            if path in ALLOWED_WRITABLE:
                continue
            if st.st_mode & stat.S_IWOTH:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~stat.S_IWOTH)
            keep.append(name)
        dirs[:] = keep
        for name in files:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_mode & stat.S_IWOTH:
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~stat.S_IWOTH)


def empty_dir(path):
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        os.makedirs(path, exist_ok=True)
        os.chmod(path, 0o1777)
        return
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)
        except FileNotFoundError:
            pass
    st = os.lstat(path)
    if stat.S_IMODE(st.st_mode) != 0o1777 or st.st_uid != 0:
        os.chown(path, 0, 0)
        os.chmod(path, 0o1777)


def fresh_private(path):
    """Empties the call uid's own dir, keeping the dir (metadata operations on the overlay are slow)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        st = None
    if st is None:
        os.mkdir(path, 0o700)
        os.chown(path, UID, GID)
        return
    for e in os.scandir(path):
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)
        except FileNotFoundError:
            pass
    # The call owns the dir and may have changed its mode; it cannot have changed its owner.
    if stat.S_IMODE(st.st_mode) != 0o700 or st.st_uid != UID or st.st_gid != GID:
        os.chown(path, UID, GID)
        os.chmod(path, 0o700)


def clean_scratch():
    """Empties every place the call uid may write and watches them again (watch_scratch)."""
    for d in SCRATCH:
        empty_dir(d)
    fresh_private(WORK)
    fresh_private(HOME)
    watch_scratch()


def watch_scratch():
    """Watches the emptied scratch places, so a call that left them alone skips clean_scratch.

    A call can leave something there only by making an entry in one of them
    (nothing else is writable by its uid, and each starts empty), or by
    changing the mode of its own work dir or HOME: each is an event on the
    watched directory, queued before the call's system call returns, so it
    is there to read once the call's processes are gone. A full queue
    reports an overflow, which reads as a change too. Without a watch (the
    edge's budget of inotify instances gave none: CONFIG watchScratch; or
    one that fails) every call is followed by a clean-up.
    """
    global WATCH
    if not CONFIG.get("watchScratch"):
        return
    c = libc()
    if WATCH < 0:
        WATCH = c.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if WATCH < 0:
            return
    for d in SCRATCH + [WORK, HOME]:
        # Again after a clean-up: a directory made anew needs a watch of its own.
        if c.inotify_add_watch(WATCH, os.fsencode(d), WATCH_MASK) < 0:
            os.close(WATCH)
            WATCH = -1
            return
    # What the clean-up itself caused (a directory's mode put back) is not the next call's doing.
    while scratch_touched():
        pass


def scratch_touched():
    """Whether any watched place changed since the last read (always true without a watch)."""
    if WATCH < 0:
        return True
    try:
        return bool(os.read(WATCH, 4096))
    except BlockingIOError:
        return False


def ipc_any():
    """Whether any SysV IPC object exists: one read per table, no parsing (the common answer is no)."""
    for kind in ("shm", "sem", "msg"):
        try:
            fd = os.open("/proc/sysvipc/" + kind, os.O_RDONLY)
        except OSError:
            continue
        try:
            # The header line ends at the first newline; anything after it is an object.
            text = os.read(fd, 4096)
        finally:
            os.close(fd)
        nl = text.find(b"\n")
        if nl != -1 and text[nl + 1:].strip():
            return True
    return False


def ipc_leftovers():
    found = []
    for kind in ("shm", "sem", "msg"):
        try:
            with open("/proc/sysvipc/" + kind, "rb") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 1:
                found.append((kind, int(cols[1])))
    return found


def kill_call_uid():
    """As the call uid: SIGKILL everything of that uid until nothing is left, then drop its IPC."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(GID, GID, GID)
            os.setresuid(UID, UID, UID)
            # One pass reaches every process of the uid; a second catches one
            # forked during the first. Zombies still count as signalled, so the
            # zygote's reaping loop (reap_all) decides when nothing is left.
            for _ in range(2):
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    break
            found = ipc_leftovers()
            if found:
                c = libc()
                for kind, ident in found:
                    if kind == "shm":
                        c.shmctl(ident, 0, None)
                    elif kind == "sem":
                        c.semctl(ident, 0, 0)
                    else:
                        c.msgctl(ident, 0, None)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def count_call_processes():
    n = 0
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                if os.stat(e.path).st_uid == UID:
                    n += 1
            except OSError:
                pass
    return n


def reap_all(deadline):
    """Reaps every child (orphans of the call are ours: we are the subreaper). False if some would not die."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            if time.monotonic() > deadline:
                return False
            kill_call_uid()
            time.sleep(0.001)


def safe_rel(path):
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts)


class Prep:
    """What a call's child needs, computed in the zygote before the fork.

    Every page the child writes is copied from the zygote's (copy on write),
    and Python code touches many (reference counts of the functions and
    objects it uses): building this here halved the child's page faults.
    Nothing of the call's code runs here; an error is the child's to report.
    """

    __slots__ = ("error", "limits", "env", "env_data", "args", "entry", "lines", "code", "started")


def prepare(req):
    p = Prep()
    p.error = None
    try:
        mem = int(req.get("memoryMb") or CONFIG["memoryMb"]) * 1024 * 1024
        nproc = int(req.get("nproc") or CONFIG["nproc"])
        cpu = int(req["timeoutMs"] / 1000) + 2
        fsize = int(req.get("fsizeMb") or CONFIG["fsizeMb"]) * 1024 * 1024
        p.limits = ((resource.RLIMIT_DATA, (mem, mem)), (resource.RLIMIT_NPROC, (nproc, nproc)),
                    (resource.RLIMIT_CPU, (cpu, cpu)), (resource.RLIMIT_FSIZE, (fsize, fsize)),
                    (resource.RLIMIT_CORE, (0, 0)))
        p.started = b'{"t":"started","id":%d}\n' % int(req["id"])
        call_env = req.get("env")
        env = dict(BASE_ENV)
        if call_env:
            env.update(call_env)
        p.env = env
        p.args = [str(a) for a in (req.get("args") or [])]
        p.entry = os.path.join(WORK, CONFIG["entry"])
        if MODE == "python":
            # os.environ's own store, as os.environ would encode it; None when the call adds
            # nothing: the zygote's own environment is then the call's (set_base_env).
            p.env_data = {os.fsencode(k): os.fsencode(v) for k, v in env.items()} if call_env else None
            src = req["code"]
            p.lines = (len(src), None, src.splitlines(True), p.entry)
            # A short program is compiled here too (compiling only parses: nothing of the call
            # runs), which spares the child the compiler's copy-on-write faults (about 50 of
            # its 370). A long one is compiled in the child: what the compiler allocates here
            # stays in the zygote's heap, and every later fork would copy it. So is one that
            # does not compile cleanly: its errors and warnings (made errors here) are the
            # child's to print, as python prints them, on the call's stderr.
            # (The compiler's warnings name the program's file: the filter main() puts first
            # makes those errors here, and the child takes it away again.)
            p.code = None
            if len(src) <= PRECOMPILE_MAX_CHARS:
                try:
                    p.code = compile(src, p.entry, "exec")
                except Exception:
                    p.code = None
    except Exception as e:
        p.error = e
    return p


def child(req, prep, stdin_fd, out_w, err_w, status_w, closers):
    try:
        os.setsid()
        for fd in closers:
            os.close(fd)
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for fd in (stdin_fd, out_w, err_w):
            if fd > 2:
                os.close(fd)
        if prep.error is not None:
            raise prep.error
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        os.write(fd, b"1000")
        os.close(fd)
        for which, limit in prep.limits:
            resource.setrlimit(which, limit)
        os.setgroups([])
        os.setresgid(GID, GID, GID)
        os.setresuid(UID, UID, UID)
        os.umask(0o022)
        os.chdir(WORK)
        for rel, text in (req.get("files") or {}).items():
            if not safe_rel(rel):
                raise ValueError("bad file path " + repr(rel))
            d = os.path.dirname(rel)
            if d:
                os.makedirs(d, exist_ok=True)
            with open(rel, "w", encoding="utf-8") as f:
                f.write(text)
        entry = prep.entry
        # The python fast path compiles the code from memory (tracebacks get
        # it from linecache): no file to write and delete per call.
        if MODE != "python":
            with open(entry, "w", encoding="utf-8") as f:
                f.write(req["code"])
        elif prep.env_data is not None:
            # The process environment (what subprocesses inherit) and os.environ, without
            # os.environ's Python-level mapping methods (each touches pages to copy).
            for k in list(os.environ._data):
                os.unsetenv(k)
            for k, v in prep.env_data.items():
                os.putenv(k, v)
            os.environ._data = prep.env_data
    except BaseException as e:
        try:
            os.write(2, ("fncall: cannot set the call up: %s\n" % (e,)).encode())
        finally:
            os._exit(126)
    if MODE == "python":
        run_python(req, prep, status_w)
    env = prep.env
    os.close(status_w)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    argv = [a.replace("{entry}", entry) for a in CONFIG["command"]] + prep.args
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        os.write(2, ("fncall: cannot run %s: %s\n" % (argv[0], e.strerror)).encode())
        os._exit(127)


def print_user_traceback(e):
    """As python itself prints it: from the program's frame, without the zygote's."""
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)


def run_python(req, prep, status_w):
    # random was reseeded before the fork (preload); a process the program forks reseeds it again.
    if RANDOM_HOOK is not None:
        os.register_at_fork(after_in_child=RANDOM_HOOK)
    src = req["code"]
    entry = prep.entry
    linecache.cache[entry] = prep.lines
    sys.stdin, sys.stdout, sys.stderr = STD
    sys.argv = [entry] + prep.args
    sys.path[0] = WORK
    main = MAIN
    sys.modules["__main__"] = main
    code = 0
    try:
        # The zygote's own first warnings filter (main) is not the program's.
        del warnings.filters[0]
        warnings._filters_mutated()
        code_obj = prep.code
        if code_obj is None:
            code_obj = compile(src, entry, "exec")
        exec(code_obj, main.__dict__)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except MemoryError as e:
        os.write(status_w, b"M")
        try:
            print_user_traceback(e)
        except BaseException:
            pass
        code = 1
    except BaseException as e:
        print_user_traceback(e)
        code = 1
    try:
        import atexit
        atexit._run_exitfuncs()
    except BaseException:
        pass
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except BaseException:
            if code == 0:
                code = 120
    os._exit(code)


def failed(req, outcome, retire, reason):
    """The done line of a call the zygote could not run."""
    return (json.dumps({"t": "done", "id": req["id"], "exitCode": -1, "signal": None, "outcome": outcome,
                        "stdout": "", "stderr": "", "stdoutBytes": 0, "stderrBytes": 0, "truncated": False,
                        "durationMs": 0, "leftover": 0, "retire": retire, "reason": reason},
                       ensure_ascii=False) + "\n").encode("utf-8", "surrogateescape")


def run_call(req):
    cap = int(req.get("maxOutputBytes") or 1048576)
    timeout_s = req["timeoutMs"] / 1000.0
    stdin_fd = os.memfd_create("fncall-stdin", os.MFD_CLOEXEC)
    data = (req.get("stdin") or "").encode("utf-8")
    view = memoryview(data)
    while view:
        view = view[os.write(stdin_fd, view):]
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    prep = prepare(req)
    # Everything the parent needs while the call runs is made before the fork: each page
    # it writes while the child lives is copied (a fault), each written before is not.
    bufs = {out_r: [], err_r: []}
    totals = {out_r: 0, err_r: 0}
    kept = {out_r: 0, err_r: 0}
    open_fds = [out_r, err_r]
    # The status pipe's write end lives on in whatever the program forked: never block on it.
    for fd in (out_r, err_r, status_r):
        os.set_blocking(fd, False)
    started_line = prep.started if prep.error is None else b'{"t":"started","id":%d}\n' % int(req["id"])
    ended = None
    status = None
    leftover = 0

    def take(fd):
        nonlocal ended
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                return False
            totals[fd] += len(chunk)
            room = cap - kept[fd]
            if room > 0:
                bufs[fd].append(chunk[:room])
                kept[fd] += min(room, len(chunk))
            if totals[fd] > cap and ended is None:
                ended = "output_limit"

    wait_fds = [out_r, err_r, 0]
    if RESEED is not None:
        RESEED()
    started = time.monotonic()
    deadline = started + timeout_s
    try:
        pid = os.fork()
    except OSError as e:
        for fd in (stdin_fd, out_r, out_w, err_r, err_w, status_r, status_w):
            os.close(fd)
        return failed(req, "pids_limit" if e.errno == errno.EAGAIN else "runtime_error",
                      e.errno != errno.EAGAIN, "fork: " + e.strerror)
    if pid == 0:
        child(req, prep, stdin_fd, out_w, err_w, status_w, [out_r, err_r, status_r, CHANNEL_IN, 1] + ([WATCH] if WATCH >= 0 else []))
    write_all(started_line)
    for fd in (stdin_fd, out_w, err_w, status_w):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    wait_fds[2] = pidfd
    while status is None:
        now = time.monotonic()
        if ended is None and now >= deadline:
            ended = "timeout"
        if ended is not None:
            leftover = count_call_processes()
            os.kill(pid, signal.SIGKILL)
            kill_call_uid()
            _, status = os.waitpid(pid, 0)
            break
        ready, _, _ = select.select(wait_fds, [], [], max(0.0, deadline - now))
        for fd in ready:
            if fd == pidfd:
                _, status = os.waitpid(pid, 0)
            elif not take(fd):
                open_fds.remove(fd)
                wait_fds.remove(fd)
    duration_ms = (time.monotonic() - started) * 1000.0
    os.close(pidfd)
    # What the program wrote before it ended is in the pipes; whatever holds them open now is a leftover.
    for fd in (out_r, err_r):
        if fd in open_fds:
            take(fd)
    oom_flag = False
    try:
        oom_flag = os.read(status_r, 1) == b"M"
    except OSError:
        pass
    try:
        more = os.waitpid(-1, os.WNOHANG) is not None
    except ChildProcessError:
        more = False
    if more or ipc_any():
        leftover = max(leftover, count_call_processes())
        kill_call_uid()
    healthy = reap_all(time.monotonic() + 5)
    for fd in (out_r, err_r, status_r):
        os.close(fd)
    if scratch_touched():
        clean_scratch()
    sig = None
    if os.WIFSIGNALED(status):
        num = os.WTERMSIG(status)
        try:
            sig = signal.Signals(num).name
        except ValueError:
            sig = "SIG%d" % num
        code = 128 + num
    else:
        code = os.WEXITSTATUS(status)
    outcome = ended or ("oom" if oom_flag else ("signaled" if sig else "ok"))
    nproc = int(req.get("nproc") or CONFIG["nproc"])
    # The uid's process count stood at (or near) its NPROC limit: a fork bomb, however it ended.
    if leftover * 4 >= nproc * 3 and outcome in ("ok", "timeout", "signaled"):
        outcome = "pids_limit"
    # The done line, written out here: json.dumps's Python layers (a new encoder per call)
    # touched about a hundred pages of the zygote per call, each a page fault after a fork.
    return ('{"t":"done","id":%d,"exitCode":%d,"signal":%s,"outcome":"%s","stdout":%s,"stderr":%s,'
            '"stdoutBytes":%d,"stderrBytes":%d,"truncated":%s,"durationMs":%.3f,"leftover":%d,"retire":%s}\n' % (
                int(req["id"]), code, "null" if sig is None else json_str(sig), outcome,
                json_str(b"".join(bufs[out_r]).decode("utf-8", "replace")),
                json_str(b"".join(bufs[err_r]).decode("utf-8", "replace")),
                totals[out_r], totals[err_r],
                "true" if totals[out_r] > cap or totals[err_r] > cap else "false",
                duration_ms, leftover, "false" if healthy else "true",
            )).encode("utf-8", "surrogateescape")


def preload(names):
    """Imports what calls commonly import, once here instead of once per call.

    random reseeds itself in every forked child (an os.register_at_fork
    hook): Python code that touched about 40 of the zygote's pages in each
    call's child, each a copy-on-write fault. Its hook is held back while
    the preloads are imported (every other module's is registered as it
    asked); instead the zygote reseeds it, in C, before each fork (RESEED),
    and the call's child registers the hook again (run_python), so a process
    the program forks reseeds as it would under python3.
    """
    global RESEED, RANDOM_HOOK
    hooks = []
    register = os.register_at_fork
    os.register_at_fork = lambda **kw: hooks.append(kw)
    try:
        for name in names:
            try:
                __import__(name)
            except Exception:
                pass
    finally:
        os.register_at_fork = register
    rnd = sys.modules.get("random")
    inst = getattr(rnd, "_inst", None)
    for kw in hooks:
        if inst is not None and RANDOM_HOOK is None and kw == {"after_in_child": inst.seed}:
            import _random
            RANDOM_HOOK = inst.seed
            # The C seed (from the OS's random source), without Random.seed's Python frame.
            RESEED = _random.Random.seed.__get__(inst)
        else:
            register(**kw)


def set_base_env():
    """The zygote's environment becomes every call's base: a call without env of its own keeps it."""
    for k in list(os.environ._data):
        os.unsetenv(k)
    data = {os.fsencode(k): os.fsencode(v) for k, v in BASE_ENV.items()}
    for k, v in data.items():
        os.putenv(k, v)
    os.environ._data = data


def main():
    libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    seal_root()
    os.makedirs("/fncall", exist_ok=True)
    os.chmod("/fncall", 0o755)
    # Made fresh here and again after every call that touched them, so each call starts with
    # empty ones.
    clean_scratch()
    set_base_env()
    global inp
    # The channel moves to another fd; fd 0 becomes an empty memfd, the kind of file a
    # call's stdin is (the stdin stream prepare makes for the child probes it).
    global CHANNEL_IN
    CHANNEL_IN = os.dup(0)
    inp = os.fdopen(CHANNEL_IN, "rb")
    blank = os.memfd_create("fncall-blank", os.MFD_CLOEXEC)
    os.dup2(blank, 0)
    os.close(blank)
    if MODE == "python":
        global STD, MAIN
        # Bound to fds 0, 1 and 2 by number: in a child those are the call's stdin memfd and
        # output pipes, here an empty memfd and pipes, so nothing they probed differs (stdin
        # is seekable, as a file redirected to python3 is).
        STD = (
            io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8"),
            io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8"),
            io.TextIOWrapper(
                io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                encoding="utf-8", errors="backslashreplace", line_buffering=True,
            ),
        )
        MAIN = types.ModuleType("__main__")
        MAIN.__file__ = os.path.join(WORK, CONFIG["entry"])
        MAIN.__builtins__ = builtins
        # Warnings about the program's file (the compiler's, when prepare compiles it) are
        # errors in the zygote: the child then compiles it again and prints them itself.
        import re
        warnings.filterwarnings("error", module=re.escape(MAIN.__file__[:-3] if MAIN.__file__.endswith(".py") else MAIN.__file__) + r"\Z")
        preload(CONFIG.get("preload") or [])
    # What the zygote holds now is never collected: the garbage collector of
    # a call does not walk (and so copy) the zygote's pages.
    import gc
    gc.collect()
    # Every page the zygote has mapped is copied into each call's page table at the fork and
    # torn down at its exit: give the heap's free pages (the set-up's garbage, about a
    # quarter of it) back first.
    libc().malloc_trim(0)
    gc.freeze()
    send({"t": "ready", "pid": os.getpid()})
    while True:
        line = inp.readline()
        if not line:
            return
        req = json.loads(line)
        try:
            done = run_call(req)
        except Exception as e:
            done = failed(req, "runtime_error", True, "zygote: %r" % (e,))
        write_all(done)


main()
`;
