"""Start N local ranks of a Python script (or any program), torchrun style.

::

    python -m chorus.run -n 4 [--master-port P] [--timeout SECS] [--grace SECS] script.py args...
    python -m chorus.run -n 4 -m package.module args...
    python -m chorus.run -n 4 -- program args...

The same launcher as the ``chorus-run`` binary, in Python, so that a
``pip install`` of the package is all a user needs. Each rank gets:

- ``RANK``, ``LOCAL_RANK``: 0..N-1; ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``: N;
- ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``: ``--master-port``, else a port
  free for both UDP (the QUIC store rank 0 hosts) and TCP;
- ``CHORUS_SECRET``: inherited if set and non-empty, else 32 random bytes
  (hex), fresh for each launch;
- ``CHORUS_JOB_ID``: inherited if set and non-empty, else fresh: it scopes
  every store key, so a relaunch never sees the last job's keys.

``CHORUS_RANK``/``CHORUS_SIZE``, ``OMPI_COMM_WORLD_*`` and ``PMI_*`` are
removed from the ranks' environment (bootstrap would prefer them).

Every line a rank writes is prefixed with ``[rank R] ``. Exit status: 0 when
every rank exits 0; when one fails, the others are stopped (SIGTERM to each
rank's process group, SIGKILL after ``--grace`` seconds) and the launcher
exits with that rank's code (128+signal if killed); 124 when ``--timeout``
expires; 2 for a usage error; 127 when the program cannot be started.
"""

import argparse
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

EXIT_TIMEOUT = 124
EXIT_CANNOT_START = 127

_LAUNCHER_VARS = (
    "CHORUS_RANK",
    "CHORUS_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
)


def free_port(attempts=64):
    """A port on 127.0.0.1 that is free for both TCP and UDP right now."""
    last = None
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind(("127.0.0.1", 0))
            port = tcp.getsockname()[1]
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                    udp.bind(("127.0.0.1", port))
            except OSError as e:
                last = e
                continue
            return port
    raise RuntimeError(f"cannot find a free port on 127.0.0.1 ({last}); pass --master-port")


def rank_env(rank, nproc, port, secret, job_id, base=None):
    """The environment of one rank."""
    env = dict(os.environ if base is None else base)
    for var in _LAUNCHER_VARS:
        env.pop(var, None)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        CHORUS_SECRET=secret,
        CHORUS_JOB_ID=job_id,
    )
    return env


def _command(args):
    if args.module:
        return [sys.executable, "-m", args.module, *args.command]
    prog, *rest = args.command
    if prog.endswith(".py") or (os.path.isfile(prog) and not os.access(prog, os.X_OK)):
        return [sys.executable, prog, *rest]
    return [prog, *rest]


def _pump(stream, prefix, out, lock, done):
    try:
        for line in iter(stream.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                try:
                    out.write(prefix + line)
                    out.flush()
                except (BrokenPipeError, ValueError):
                    pass  # our output is gone: keep draining the rank's pipe
    finally:
        stream.close()
        done.put(None)


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m chorus.run",
        description="Start N local ranks with the environment Chorus bootstraps from.",
    )
    p.add_argument("-n", "--nproc", type=int, required=True, help="number of ranks")
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--timeout", type=float, default=None, help="stop every rank after SECS")
    p.add_argument("--grace", type=float, default=5.0, help="SIGTERM to SIGKILL, seconds")
    p.add_argument("-m", dest="module", default=None, help="run a module, as python -m")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.nproc < 1:
        p.error("-n must be at least 1")
    if not args.module and not args.command:
        p.error("no program given")
    return args


def main(argv=None):
    args = _parse(sys.argv[1:] if argv is None else argv)
    port = args.master_port or free_port()
    secret = os.environ.get("CHORUS_SECRET") or secrets.token_hex(32)
    job_id = os.environ.get("CHORUS_JOB_ID") or secrets.token_hex(8)
    cmd = _command(args)
    lock = threading.Lock()
    outputs = queue.Queue()
    events = queue.Queue()
    procs = []
    streams = 0
    stop_code = None

    def on_signal(signum, _frame):
        events.put(("signal", signum))

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)

    for rank in range(args.nproc):
        try:
            proc = subprocess.Popen(
                cmd,
                env=rank_env(rank, args.nproc, port, secret, job_id),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            print(f"chorus.run: cannot start rank {rank}: {cmd[0]}: {e}", file=sys.stderr)
            stop_code = EXIT_CANNOT_START
            break
        procs.append(proc)
        prefix = f"[rank {rank}] ".encode()
        for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            threading.Thread(
                target=_pump, args=(stream, prefix, out, lock, outputs), daemon=True
            ).start()
            streams += 1

        def wait(r=rank, p=proc):
            events.put(("exit", r, p.wait()))

        threading.Thread(target=wait, daemon=True).start()

    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    running = len(procs)
    terminated_at = None
    killed = False
    if stop_code is not None:
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        terminated_at = time.monotonic()

    while running:
        now = time.monotonic()
        waits = [0.5]
        if deadline is not None and stop_code is None:
            waits.append(max(0.0, deadline - now))
        if terminated_at is not None and not killed:
            waits.append(max(0.0, terminated_at + args.grace - now))
        try:
            ev = events.get(timeout=min(waits))
        except queue.Empty:
            ev = None
        now = time.monotonic()
        if ev is not None and ev[0] == "exit":
            _, rank, code = ev
            running -= 1
            if code != 0 and stop_code is None:
                stop_code = code if code > 0 else 128 - code
                print(
                    f"chorus.run: rank {rank} exited with status {code}; stopping the others",
                    file=sys.stderr,
                )
                for p in procs:
                    _signal_group(p, signal.SIGTERM)
                terminated_at = now
        elif ev is not None and ev[0] == "signal":
            if terminated_at is not None:
                for p in procs:
                    _signal_group(p, signal.SIGKILL)
                killed = True
            else:
                stop_code = 128 + ev[1]
                for p in procs:
                    _signal_group(p, ev[1])
                terminated_at = now
        if deadline is not None and now >= deadline and stop_code is None:
            print(f"chorus.run: timeout after {args.timeout} s; stopping every rank", file=sys.stderr)
            stop_code = EXIT_TIMEOUT
            for p in procs:
                _signal_group(p, signal.SIGTERM)
            terminated_at = now
        if terminated_at is not None and not killed and now >= terminated_at + args.grace:
            for p in procs:
                _signal_group(p, signal.SIGKILL)
            killed = True

    # Output still buffered in the pipes (bounded: the ranks have exited).
    drain_until = time.monotonic() + 2.0
    for _ in range(streams):
        left = drain_until - time.monotonic()
        if left <= 0:
            break
        try:
            outputs.get(timeout=left)
        except queue.Empty:
            break
    return stop_code or 0


if __name__ == "__main__":
    sys.exit(main())
