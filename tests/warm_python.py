"""A warm Python for tests that start many Python commands (the README's blocks, every command's
``--help``): one server imports torch and the package once and forks a child per command, so a
command starts in milliseconds instead of the seconds its imports take on a CPU.

    with WarmPython() as warm:                    # the server, stopped (and its children) at the end
        warm.run(["train.py", "--help"])          # `python train.py --help`, forked from the server
        subprocess.run(["bash", "-c", "python train.py ..."], env=warm.env())  # the shim first on PATH

The tests share one server, the session fixture ``warm_python`` (tests/conftest.py).

The shim (``python`` and ``python3`` in ``warm.bin``) hands the server its arguments, working folder,
environment and standard streams (the file descriptors themselves) and exits with the command's
status. The child runs the command as ``python`` would: ``SCRIPT``, ``-m MODULE`` or ``-c CODE``
with its own ``sys.argv``, ``sys.path[0]``, ``__main__``, environment, folder, ``sys.executable`` (the
shim: the Python commands it starts are warm too), streams (unbuffered
under PYTHONUNBUFFERED), default signal handlers, reseeded global random generators, exit status
(an uncaught exception prints its traceback and exits 1, an uncaught KeyboardInterrupt ends the
shim by SIGINT) and exit handlers. The warnings and output
the server's imports gave are written to the child's stderr first, as a fresh process's imports
would write them. What differs from a new interpreter: the modules the server imported are
imported already, and OMP_NUM_THREADS takes effect through ``torch.set_num_threads``. A form the
server does not take (other interpreter options, no command, stdin) runs the real interpreter.

Run as a script it is the server: ``python tests/warm_python.py SOCKET MODULE...``.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ("torch", "mhar_titan.train", "mhar_titan.dryrun", "mhar_titan.eval.load", "mhar_titan.cli_args")
"""What the server imports before it takes commands: what nearly every command of ours imports."""

SOCKET_ENV = "MHAR_WARM_PYTHON"
"""The variable that tells the shim where the server listens."""

_SHIM = """#!{python} -IS
# `python` of a warm interpreter (tests/warm_python.py): hands the command to the server, or runs the
# real interpreter for a form the server does not take.
import json, os, socket, struct, sys
args = sys.argv[1:]
path = os.environ.get({socket_env!r})
warm = path and args and (args[0] in ("-m", "-c") and len(args) > 1 or not args[0].startswith("-"))
try:
    [os.fstat(fd) for fd in (0, 1, 2)]
except OSError:  # a closed standard stream: nothing to hand over
    warm = False
if not warm:
    os.execv({python!r}, [{python!r}, *args])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
body = json.dumps(dict(argv=args, cwd=os.getcwd(), env=dict(os.environ), executable=os.path.abspath(sys.argv[0]))).encode()
socket.send_fds(s, [struct.pack("!Q", len(body)) + body], [0, 1, 2])
status = s.recv(4)
code = struct.unpack("!i", status)[0] if len(status) == 4 else 1
if code < 0:  # the command ended by a signal (an uncaught KeyboardInterrupt: SIGINT): so does the shim
    import signal
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


class WarmPython:
    """The server (started on enter, stopped with every child it forked on exit) and its shim folder."""

    def __init__(self, preload=PRELOAD, interpreter: str = sys.executable):
        self.preload, self.interpreter = tuple(preload), interpreter
        self.folder = Path(tempfile.mkdtemp(prefix="warm-python-"))
        self.bin = self.folder / "bin"
        self.socket = self.folder / "server.sock"
        self.proc = None

    def __enter__(self) -> "WarmPython":
        self.bin.mkdir()
        for name in ("python", "python3"):
            shim = self.bin / name
            shim.write_text(_SHIM.format(python=self.interpreter, socket_env=SOCKET_ENV))
            shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        self.proc = subprocess.Popen([self.interpreter, __file__, str(self.socket), *self.preload], start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 600
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the warm Python server exited {self.proc.returncode}: "
                                   f"{self.proc.stderr.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the warm Python server did not start within 600 s")
            time.sleep(0.05)
        return self

    @property
    def python(self) -> str:
        """The shim: ``python`` of this warm interpreter."""
        return str(self.bin / "python")

    def env(self, base: dict | None = None) -> dict:
        """``base`` (default: this process's environment) with the shim first on PATH and the
        server's socket named."""
        base = dict(os.environ) if base is None else base
        return {**base, "PATH": f"{self.bin}{os.pathsep}{base.get('PATH', '')}", SOCKET_ENV: str(self.socket)}

    def run(self, args: list, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
        """``python ARGS`` through the shim (text, output captured, from the repository root unless
        ``cwd`` is given), with ``env`` (default: this process's environment)."""
        kwargs = {"capture_output": True, "text": True, "cwd": Path(__file__).resolve().parents[1], **kwargs}
        return subprocess.run([self.python, *map(str, args)], env=self.env(env), **kwargs)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server and the children it forked
            self.proc.wait()
            self.proc.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- the server ------------------------------------------------------------------------------------

def _streams(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr on file descriptors 0-2, as the interpreter makes them."""
    def text(fd, mode, **kw):
        return io.TextIOWrapper(open(fd, mode, buffering=-1, closefd=False), encoding="utf-8",
                                errors="backslashreplace" if fd == 2 else "strict", **kw)
    sys.stdin = sys.__stdin__ = text(0, "rb")
    line = unbuffered or os.isatty(1)
    sys.stdout = sys.__stdout__ = text(1, "wb", line_buffering=line, write_through=unbuffered)
    sys.stderr = sys.__stderr__ = text(2, "wb", line_buffering=True, write_through=True)


def _run(argv: list[str]) -> int:
    """Run ``python ARGV`` in this process; its exit status."""
    import runpy
    import traceback

    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            module = sys.modules.get(argv[1])
            if module is not None and not hasattr(module, "__path__"):
                del sys.modules[argv[1]]  # imported by the server: `python -m` runs a module not imported yet
            sys.modules["__main__"] = type(sys)("__main__")  # runs in the __main__ module's namespace
            runpy._run_module_as_main(argv[1], alter_argv=True)  # what `python -m` calls
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = sys.modules["__main__"] = type(sys)("__main__")
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001  (as the interpreter: the traceback without this frame, exit 1)
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        return -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1  # an interrupt ends by SIGINT


def _child(request: dict, fds: list[int], conn: socket.socket, replay: str) -> None:
    """In the forked child: become the command's process, run it, report its status, exit."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else
                      signal.SIG_IGN if sig == signal.SIGPIPE else signal.SIG_DFL)  # as the interpreter sets them
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.executable = request["executable"]  # the `python` it was started as: a command's own children are warm too
    _streams(bool(os.environ.get("PYTHONUNBUFFERED")))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a new process draws a new seed (random reseeds itself at fork)
    if "torch" in sys.modules and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.stderr.write(replay)
    code = _run(request["argv"])
    import atexit
    import threading

    with contextlib.suppress(BaseException):
        threading._shutdown()  # non-daemon threads end, as at interpreter exit
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    with contextlib.suppress(OSError):
        conn.sendall(struct.pack("!i", code if code < 0 else code % 256))  # < 0: the signal that ends it
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code % 256)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    size = struct.unpack("!Q", data[:8])[0]
    body = data[8:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ConnectionError("the shim closed the connection")
        body += more
    return json.loads(body), list(fds)


def serve(path: str, preload: list[str]) -> None:
    import importlib
    import warnings

    captured = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(captured), \
            contextlib.redirect_stderr(captured):
        for name in preload:
            importlib.import_module(name)
    replay = captured.getvalue() + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
                                           for w in caught)
    def reap(*_):  # each child reports its status to its shim; reaped here so that its CPU time counts
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass

    signal.signal(signal.SIGCHLD, reap)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(64)
    os.rename(path + ".tmp", path)  # the socket appears once it listens
    while True:
        conn, _ = server.accept()
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError, ConnectionError):
            conn.close()
            continue
        if os.fork() == 0:
            server.close()
            try:
                _child(request, fds, conn, replay)
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
