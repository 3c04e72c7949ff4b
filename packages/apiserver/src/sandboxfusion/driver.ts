/**
 * The program a SandboxFusion call runs as its FnCall (python mode, in the
 * worker's zygote): it reads its task from stdin (one JSON object the
 * apiserver wrote: `SandboxFusionTask`), writes the caller's files into the
 * call's work dir, compiles (with the compile timeout), runs (with the run
 * timeout, stdin and the memory limit), reads back `fetch_files`, and prints
 * one JSON line: `SandboxFusionDriverAnswer`, streams and files as base64 so
 * any bytes survive. It runs inside the worker sandbox as the call's uid;
 * nothing of it runs on the host.
 *
 * Paths are walked one component at a time from the work dir with
 * O_NOFOLLOW, so neither a file the caller sends nor one it fetches can go
 * through a symlink the program made, and only regular files are read.
 */
/** What both programs share: reading the task, writing files, becoming a step's program. */
const COMMON_HEAD = String.raw`
import base64, json, os, signal, sys, types

def _main():
    task = json.loads(sys.stdin.buffer.read())
    work = os.getcwd()
    caps = task["caps"]

    def walk_dir(parts, create):
        fd = os.open(work, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def write_file(rel, data):
        parts = rel.split("/")
        dfd = walk_dir(parts[:-1], True)
        try:
            fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
`;

/** The full driver's extra: reading fetched files back (walked as the writes are). */
const READ_BLOCK = String.raw`    def read_file(rel, budget):
        parts = rel.split("/")
        try:
            dfd = walk_dir(parts[:-1], False)
        except OSError:
            return None, "missing"
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        except OSError:
            return None, "missing"
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, "not a regular file"
            if st.st_size > budget:
                return None, "too large"
            chunks = []
            left = budget + 1
            while left > 0:
                b = os.read(fd, min(left, 1 << 20))
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
            data = b"".join(chunks)
            if len(data) > budget:
                return None, "too large"
            return data, None
        finally:
            os.close(fd)
`;

const MIDDLE = String.raw`    for rel, b64 in task["files"].items():
        write_file(rel, base64.b64decode(b64))
    # A python program runs from memory (as FnCall's python fast path does): a call that
    # writes nothing into the work dir spares the worker its clean-up afterwards.
    in_memory = "python" in task["run"] and not task.get("compile")
    if not in_memory:
        write_file(task["source"], task["code"].encode("utf-8", "surrogatepass"))

    def stdin_fd(stdin):
        fd = os.memfd_create("sf-stdin", os.MFD_CLOEXEC)
        view = memoryview(stdin or b"")
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def become(step, in_fd, mem_mb):
        """Turns this process into the step's program (fd 0 its stdin; 1 and 2 as they are). Never returns."""
        try:
            os.dup2(in_fd, 0)
            if mem_mb > 0:
                import resource
                lim = mem_mb * 1024 * 1024
                soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
                if hard == resource.RLIM_INFINITY or lim < hard:
                    resource.setrlimit(resource.RLIMIT_DATA, (lim, lim))
            for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            if "argv" in step:
                argv = step["argv"]
                os.execvpe(argv[0], argv, dict(os.environ, **step.get("env", {})))
            path = os.path.join(work, step["python"])
            src = task["code"]
            import linecache
            linecache.cache[path] = (len(src), None, src.splitlines(True), path)
            sys.stdin = open(0, "r", encoding="utf-8", errors="surrogateescape", closefd=False)
            sys.stdout = open(1, "w", encoding="utf-8", errors="surrogateescape", closefd=False)
            sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
            sys.argv = [path]
            sys.path[0] = work
            main = types.ModuleType("__main__")
            main.__file__ = path
            sys.modules["__main__"] = main
        except OSError as e:
            os.write(2, ("sandboxfusion: cannot run %s: %s\n" % (step.get("argv", ["python"])[0], e.strerror)).encode())
            os._exit(127)
        except BaseException as e:
            try:
                os.write(2, ("sandboxfusion: %s\n" % (e,)).encode())
            finally:
                os._exit(126)
        code = 0
        try:
            exec(compile(src, path, "exec", dont_inherit=True), main.__dict__)
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code & 0xFF
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException as e:
            import traceback
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
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
                code = code or 120
        os._exit(code)

    if task.get("direct"):
        # One step, nothing to fetch: this process becomes the program, and the call's own
        # stdout, stderr, exit and time limit are the step's (no second fork, no copy).
        stdin = task["stdin"]
        become(task["run"], stdin_fd(None if stdin is None else stdin.encode("utf-8", "surrogatepass")), task["memory_mb"])
`;

/** The full driver's steps in children, time limits and the answer line. */
const FULL_TAIL = String.raw`    import selectors, stat, time
    def run(step, timeout, stdin, mem_mb):
        """Runs one step in a child: {"argv": [...]} (exec) or {"python": path} (this interpreter)."""
        cap = caps["stream"]
        in_fd = stdin_fd(stdin)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except BaseException:
                pass
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            try:
                os.setpgid(0, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
            except BaseException:
                os._exit(126)
            become(step, in_fd, mem_mb)
        os.close(in_fd)
        os.close(out_w)
        os.close(err_w)
        pidfd = os.pidfd_open(pid)
        bufs = {out_r: [], err_r: []}
        sizes = {out_r: 0, err_r: 0}
        sel = selectors.DefaultSelector()
        sel.register(out_r, selectors.EVENT_READ)
        sel.register(err_r, selectors.EVENT_READ)
        sel.register(pidfd, selectors.EVENT_READ)
        deadline = start + timeout
        status = None
        timed_out = False
        open_pipes = 2
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(left):
                fd = key.fd
                if fd == pidfd:
                    status = os.waitpid(pid, 0)[1]
                    sel.unregister(pidfd)
                    continue
                b = os.read(fd, 65536)
                if not b:
                    sel.unregister(fd)
                    open_pipes -= 1
                    continue
                room = cap - sizes[fd]
                if room > 0:
                    bufs[fd].append(b[:room])
                sizes[fd] += len(b)
            if status is not None:
                # Exited: what is in the pipes now is its output; a process it left behind
                # that still holds them is not waited for.
                for fd in (out_r, err_r):
                    try:
                        os.set_blocking(fd, False)
                        while True:
                            b = os.read(fd, 65536)
                            if not b:
                                break
                            room = cap - sizes[fd]
                            if room > 0:
                                bufs[fd].append(b[:room])
                            sizes[fd] += len(b)
                    except (BlockingIOError, OSError):
                        pass
                break
        elapsed = time.monotonic() - start
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        if status is None:
            status = os.waitpid(pid, 0)[1]
        os.close(pidfd)
        os.close(out_r)
        os.close(err_r)
        res = {
            "status": "TimeLimitExceeded" if timed_out else "Finished",
            "execution_time": elapsed,
            "stdout": base64.b64encode(b"".join(bufs[out_r])).decode(),
            "stderr": base64.b64encode(b"".join(bufs[err_r])).decode(),
            "truncated": sizes[out_r] > cap or sizes[err_r] > cap,
        }
        if not timed_out:
            res["return_code"] = os.waitstatus_to_exitcode(status)
        return res

    answer = {"compile": None, "run": None, "files": {}, "skipped": {}}
    ok = True
    if task.get("compile"):
        c = run(task["compile"], task["compile_timeout"], None, -1)
        answer["compile"] = c
        ok = c["status"] == "Finished" and c.get("return_code") == 0
    if ok:
        stdin = task["stdin"]
        answer["run"] = run(
            task["run"],
            task["run_timeout"],
            None if stdin is None else stdin.encode("utf-8", "surrogatepass"),
            task["memory_mb"],
        )
    budget = caps["files"]
    for rel in task["fetch_files"]:
        data, why = read_file(rel, budget)
        if data is None:
            answer["skipped"][rel] = why
            continue
        budget -= len(data)
        answer["files"][rel] = base64.b64encode(data).decode()
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
`;

/**
 * The full driver: compile and run steps in children of its own, fetched
 * files, one JSON answer line.
 */
export const SANDBOXFUSION_DRIVER = [
  COMMON_HEAD,
  READ_BLOCK,
  MIDDLE,
  FULL_TAIL,
  '_main()',
  '',
].join('\n');

/**
 * The direct driver, for one step and nothing to fetch: it writes the files
 * and becomes the program, so the call's own result is the step's. Short, as
 * the worker compiles the program it is sent on every call.
 */
export const SANDBOXFUSION_DIRECT_DRIVER = [COMMON_HEAD, MIDDLE, '_main()', ''].join('\n');
