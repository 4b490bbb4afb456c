"""Run TorchComms' own Python integration tests on Chorus and report, per
file, what passed, failed and was skipped.

    python scripts/torchcomms_suite.py --checkout PATH/TO/torchcomms [-n 4] [FILE ...]

``PATH/TO/torchcomms`` is a checkout of meta-pytorch/torchcomms. The tests
run unchanged: a ``torchcomms`` package of a few lines (written to a
temporary directory) points ``torchcomms``, ``torchcomms._comms``,
``torchcomms.objcol``, ``torchcomms.hooks`` and ``torchcomms.device_mesh``
at ``chorus``, and carries the checkout's ``torchcomms/tests`` directory
(the tests import their helpers from there). Every file runs on ``-n``
ranks under ``python -m chorus.run`` with ``TEST_BACKEND=cpu`` and
``TEST_DEVICE=cpu``, bounded by ``--timeout`` seconds; each rank records
each test's outcome, and a test passes when it passed on every rank.

Needs torch (the tests are torch tests): run it with the Python of
``./scripts/python-test.sh --torch`` (``target/torch-venv/bin/python``).
Prints a Markdown table; ``--json`` also writes every test's outcome.
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# The shim package: torchcomms/__init__.py and one file per submodule. It
# imports nothing of torch when it is imported: torch.distributed itself
# tries ``import torchcomms`` while it loads (it finds no _BackendWrapper
# here and goes on without it).
SHIM = {
    "__init__.py": '''"""torchcomms, answered by chorus (written by scripts/torchcomms_suite.py)."""
import sys

import chorus
from chorus import *  # noqa: F401,F403
from chorus import (  # noqa: F401
    AllGatherPHandle, BatchSendRecv, Comm, CommOptions, OpName, P2POp, RedOpType,
    ReduceOp, TorchComm, TorchCommWindow, TorchCommWindowAttr, TorchCommWinAccessType,
    Work, new_comm,
)

TorchWork = Work
sys.modules[__name__ + "._comms"] = chorus


def __getattr__(name):
    if name == "_BackendWrapper":  # loaded on first use: it imports torch.distributed
        from chorus.torch import ChorusBackend

        return ChorusBackend
    raise AttributeError(name)
''',
    "objcol.py": "from chorus.objcol import *  # noqa: F401,F403\n",
    "hooks.py": "from chorus.hooks import *  # noqa: F401,F403\n",
    "device_mesh.py": "from chorus.device_mesh import (  # noqa: F401\n"
                      "    _create_torchcomm_process_group, _flatten_with_comm, init_device_mesh)\n",
    "functional.py": "from chorus.functional import *  # noqa: F401,F403\n",
}

RANK_RUNNER = '''"""One rank of one TorchComms test file: run it with unittest and write
each test's outcome to OUT/<rank>.json."""
import json
import os
import sys
import time
import traceback
import unittest

path, out = sys.argv[1], sys.argv[2]
rank = os.environ.get("RANK", "0")
results = {}


class Result(unittest.TextTestResult):
    def startTest(self, test):
        self._t0 = time.monotonic()
        super().startTest(test)

    def _put(self, test, status, detail=""):
        results[test.id()] = {
            "status": status,
            "detail": detail[-2000:],
            # Errors of setUpClass and the like come before any startTest.
            "seconds": round(time.monotonic() - getattr(self, "_t0", time.monotonic()), 3),
        }

    def addSuccess(self, test):
        super().addSuccess(test)
        self._put(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._put(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._put(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._put(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._put(test, "passed")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._put(test, "failed", "unexpected success")


def write():
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(results, f)


try:
    sys.path.insert(0, os.path.dirname(path))
    suite = unittest.defaultTestLoader.loadTestsFromName(
        os.path.splitext(os.path.basename(path))[0]
    )
    unittest.TextTestRunner(stream=sys.stderr, resultclass=Result, verbosity=0).run(suite)
except BaseException:  # an import error fails the whole file
    results["<import>"] = {"status": "error", "detail": traceback.format_exc()[-2000:],
                           "seconds": 0}
write()
os._exit(0)
'''


def run_file(py, shim_dir, path, ranks, timeout, work):
    out = os.path.join(work, os.path.basename(path) + ".out")
    os.makedirs(out, exist_ok=True)
    runner = os.path.join(work, "rank_runner.py")
    env = dict(os.environ)
    env["PYTHONPATH"] = shim_dir + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TEST_BACKEND", "cpu")
    env.setdefault("TEST_DEVICE", "cpu")
    t0 = time.monotonic()
    proc = subprocess.run(
        [py, "-m", "chorus.run", "-n", str(ranks), "--timeout", str(timeout),
         runner, path, out],
        env=env, capture_output=True, text=True,
    )
    took = time.monotonic() - t0
    per_rank = []
    for r in range(ranks):
        f = os.path.join(out, f"{r}.json")
        if os.path.exists(f):
            with open(f) as fh:
                per_rank.append(json.load(fh))
        else:
            per_rank.append(None)
    tests = {}
    names = sorted({n for res in per_rank if res for n in res})
    for name in names:
        outcomes = [res.get(name) if res else None for res in per_rank]
        statuses = [o["status"] if o else "missing" for o in outcomes]
        if all(s == "passed" for s in statuses):
            status = "passed"
        elif statuses[0] == "skipped" and all(s in ("skipped", "passed") for s in statuses):
            status = "skipped"
        else:
            status = "failed"
        detail = next((o["detail"] for o in outcomes if o and o["status"] in
                       ("failed", "error", "skipped")), "")
        tests[name] = {"status": status, "ranks": statuses, "detail": detail}
    timed_out = proc.returncode == 124 or any(res is None for res in per_rank)
    return {"tests": tests, "seconds": round(took, 1), "timed_out": timed_out,
            "launcher_rc": proc.returncode, "stderr_tail": proc.stderr[-3000:]}


def first_line(detail):
    lines = [ln for ln in detail.strip().splitlines() if ln.strip()]
    return lines[-1][:160] if lines else ""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkout", required=True, help="a meta-pytorch/torchcomms checkout")
    p.add_argument("-n", "--ranks", type=int, default=4)
    p.add_argument("--timeout", type=float, default=300, help="seconds per file")
    p.add_argument("--json", help="write every test's outcome here")
    p.add_argument("files", nargs="*", help="test files (default: every *Test.py)")
    args = p.parse_args()
    tests_src = os.path.join(args.checkout, "comms", "torchcomms", "tests")
    if not os.path.isdir(tests_src):
        sys.exit(f"{tests_src} not found: --checkout must be a torchcomms checkout")
    files = args.files or sorted(glob.glob(os.path.join(tests_src, "integration", "py", "*Test.py")))
    work = tempfile.mkdtemp(prefix="torchcomms-suite-")
    shim_dir = os.path.join(work, "shim")
    pkg = os.path.join(shim_dir, "torchcomms")
    shutil.copytree(tests_src, os.path.join(pkg, "tests"),
                    ignore=shutil.ignore_patterns("*.cpp", "*.hpp", "*.h", "cpp", "CMakeLists.txt"))
    for fname, text in SHIM.items():
        with open(os.path.join(pkg, fname), "w") as f:
            f.write(text)
    with open(os.path.join(work, "rank_runner.py"), "w") as f:
        f.write(RANK_RUNNER)
    report = {}
    for path in files:
        name = os.path.basename(path)
        r = run_file(sys.executable, shim_dir, os.path.abspath(path), args.ranks, args.timeout, work)
        report[name] = r
        c = {s: sum(t["status"] == s for t in r["tests"].values())
             for s in ("passed", "failed", "skipped")}
        flag = " (timed out)" if r["timed_out"] else ""
        print(f"{name}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
              f" in {r['seconds']} s{flag}", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    print(f"| file | passed | failed | skipped | seconds | failures (last line) |")
    print("|---|---|---|---|---|---|")
    for name, r in report.items():
        c = {s: sum(t["status"] == s for t in r["tests"].values()) for s in totals}
        for s in totals:
            totals[s] += c[s]
        fails = sorted({first_line(t["detail"]) for t in r["tests"].values()
                        if t["status"] == "failed"})
        note = "; ".join(fails[:3]) + (" ..." if len(fails) > 3 else "")
        if r["timed_out"]:
            note = "timed out; " + note
        print(f"| {name} | {c['passed']} | {c['failed']} | {c['skipped']} | {r['seconds']} "
              f"| {note.replace('|', '/')} |")
    print(f"| **total** | {totals['passed']} | {totals['failed']} | {totals['skipped']} | | |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
