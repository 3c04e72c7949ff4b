/**
 * The worker's zygote (docs/adr/0014-fncall.md): a Python script the edge
 * starts once per worker sandbox, as the sandbox's root, through chronus
 * (`python3 -c ZYGOTE_PY CONFIG`). Its stdin and stdout are the call channel,
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
export const ZYGOTE_PY = String.raw`
import builtins, errno, io, json, linecache, os, resource, select, shutil, signal, stat, sys, time, types

CONFIG = json.loads(sys.argv[1])
UID = CONFIG["uid"]
GID = CONFIG["uid"]
MODE = CONFIG["mode"]
WORK = "/fncall/work"
HOME = "/fncall/home"
# The only places the call uid may write; each is emptied after every call.
SCRATCH = ["/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue"]
ALLOWED_WRITABLE = set(SCRATCH) | {"/fncall/work", "/fncall/home"}
PR_SET_CHILD_SUBREAPER = 36

inp = sys.stdin.buffer


def write_all(data):
    # Straight to the fd: the buffered writer's layers cost more than the syscall.
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def send(obj):
    write_all(json.dumps(obj, ensure_ascii=False).encode("utf-8", "surrogateescape") + b"\n")


def libc():
    import ctypes
    return ctypes.CDLL(None, use_errno=True)


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

    __slots__ = ("error", "limits", "env", "env_data", "args", "entry", "lines", "std", "main")


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
        env = dict(CONFIG["env"])
        env.update({"HOME": HOME, "PWD": WORK, "TMPDIR": "/tmp"})
        env.update(req.get("env") or {})
        p.env = env
        p.args = [str(a) for a in (req.get("args") or [])]
        p.entry = os.path.join(WORK, CONFIG["entry"])
        if MODE == "python":
            # os.environ's own store, as os.environ would encode it.
            p.env_data = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
            src = req["code"]
            p.lines = (len(src), None, src.splitlines(True), p.entry)
            # Bound to fds 1 and 2 by number: in the child those are the call's pipes (pipes
            # here too, so nothing they probed differs). Stdin is made in the child: its
            # memfd is seekable, as a file redirected to python3 is.
            p.std = (
                io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8"),
                io.TextIOWrapper(
                    io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                    encoding="utf-8", errors="backslashreplace", line_buffering=True,
                ),
            )
            main = types.ModuleType("__main__")
            main.__file__ = p.entry
            main.__builtins__ = builtins
            p.main = main
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
        else:
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
    # random needs no seed here: it reseeds itself in every forked child
    # (os.register_at_fork), and a first import seeds from the OS.
    src = req["code"]
    entry = prep.entry
    linecache.cache[entry] = prep.lines
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout, sys.stderr = prep.std
    sys.argv = [entry] + prep.args
    sys.path[0] = WORK
    main = prep.main
    sys.modules["__main__"] = main
    code = 0
    try:
        exec(compile(src, entry, "exec"), main.__dict__)
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
    started = time.monotonic()
    try:
        pid = os.fork()
    except OSError as e:
        for fd in (stdin_fd, out_r, out_w, err_r, err_w, status_r, status_w):
            os.close(fd)
        return {"exitCode": -1, "signal": None, "outcome": "pids_limit" if e.errno == errno.EAGAIN else "runtime_error",
                "stdout": "", "stderr": "", "stdoutBytes": 0, "stderrBytes": 0, "truncated": False,
                "durationMs": 0, "leftover": 0, "retire": e.errno != errno.EAGAIN, "reason": "fork: " + e.strerror}
    if pid == 0:
        child(req, prep, stdin_fd, out_w, err_w, status_w, [out_r, err_r, status_r, 0, 1])
    write_all(b'{"t":"started","id":%d}\n' % int(req["id"]))
    for fd in (stdin_fd, out_w, err_w, status_w):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    bufs = {out_r: [], err_r: []}
    totals = {out_r: 0, err_r: 0}
    kept = {out_r: 0, err_r: 0}
    ended = None
    status = None
    leftover = 0
    deadline = started + timeout_s
    open_fds = [out_r, err_r]
    # The status pipe's write end lives on in whatever the program forked: never block on it.
    for fd in open_fds + [status_r]:
        os.set_blocking(fd, False)

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
        ready, _, _ = select.select(open_fds + [pidfd], [], [], max(0.0, deadline - now))
        for fd in ready:
            if fd == pidfd:
                _, status = os.waitpid(pid, 0)
            elif not take(fd):
                open_fds.remove(fd)
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
    for d in SCRATCH:
        empty_dir(d)
    fresh_private(WORK)
    fresh_private(HOME)
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
    return {
        "exitCode": code, "signal": sig, "outcome": outcome,
        "stdout": b"".join(bufs[out_r]).decode("utf-8", "replace"),
        "stderr": b"".join(bufs[err_r]).decode("utf-8", "replace"),
        "stdoutBytes": totals[out_r], "stderrBytes": totals[err_r],
        "truncated": totals[out_r] > cap or totals[err_r] > cap,
        "durationMs": round(duration_ms, 3), "leftover": leftover, "retire": not healthy,
    }


def main():
    libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    seal_root()
    os.makedirs("/fncall", exist_ok=True)
    os.chmod("/fncall", 0o755)
    for d in SCRATCH:
        empty_dir(d)
    # Made fresh here and again after every call, so each call starts with empty ones.
    fresh_private(WORK)
    fresh_private(HOME)
    if MODE == "python":
        # What calls commonly import, loaded once here instead of once per call.
        for name in CONFIG.get("preload") or []:
            try:
                __import__(name)
            except Exception:
                pass
    # What the zygote holds now is never collected: the garbage collector of
    # a call does not walk (and so copy) the zygote's pages.
    import gc
    gc.collect()
    gc.freeze()
    send({"t": "ready", "pid": os.getpid()})
    while True:
        line = inp.readline()
        if not line:
            return
        req = json.loads(line)
        try:
            result = run_call(req)
        except Exception as e:
            result = {"exitCode": -1, "signal": None, "outcome": "runtime_error", "stdout": "", "stderr": "",
                      "stdoutBytes": 0, "stderrBytes": 0, "truncated": False, "durationMs": 0,
                      "leftover": 0, "retire": True, "reason": "zygote: %r" % (e,)}
        result["t"] = "done"
        result["id"] = req["id"]
        send(result)


main()
`;
