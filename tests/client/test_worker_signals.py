"""Every torch DataLoader worker forked from a guarded process outlives the stop signals (issue 34).

A plain ``torch.utils.data.DataLoader`` that nobody handed to spotguard (the user's own, a
framework's validation loader) has its workers in the rank's process group, where torchrun's
``killpg``, Ctrl-C and ``scancel`` reach them. While a signal-handling ``Guard`` lives, they ignore
SIGTERM and SIGINT and the loop gets every batch; without one (before, and after it closed) they
keep torch's SIGTERM (read from /proc: a worker killed mid-way can leave torch's main process
waiting on a lock the worker held, so the test does not kill them); another forked child still ends at ``terminate()``; a process that
exits with a live iterator of such workers does not hang (``multiprocessing`` would SIGTERM and
join them).
In a process of its own (torch's SIGCHLD handler raises for dead workers wherever it runs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

JOB = """
import multiprocessing, os, signal, time
import torch
import spotguard
from spotguard.guard import Guard

got = []

def plain(persistent=False):
    data = torch.utils.data.TensorDataset(torch.arange(48.0).view(-1, 1))
    return torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, num_workers=2,
                                       multiprocessing_context="fork", persistent_workers=persistent,
                                       generator=torch.Generator().manual_seed(0))

def signalled(loader, *signals):
    it = iter(loader)
    drawn = [next(it)[0].tolist()]
    for sig in signals:  # the whole group, as torchrun's killpg, Ctrl-C, scancel
        os.killpg(0, sig)
        time.sleep(0.3)
    try:
        drawn += [b[0].tolist() for b in it]
    except RuntimeError as exc:  # torch: "DataLoader worker (pid(s) ...) exited unexpectedly"
        return "died" if "DataLoader worker" in str(exc) else repr(exc)
    return drawn

def disposition(loader):
    # What SIGTERM does to the workers of a live iterator, read from /proc. Killing them to see
    # would risk torch's own deadlock: a worker killed while it holds the shared done-event's lock
    # leaves the main process waiting on that lock for ever (about 1 run in 150 here).
    it = iter(loader)
    next(it)
    next(it)  # batches go to the workers in turn: both have started (under load, one may start late)
    masks = []
    for worker in it._workers:
        with open(f"/proc/{worker.pid}/status") as status:
            masks += [int(line.split()[1], 16) for line in status if line.startswith("SigIgn:")]
    del it
    return "ignored" if all(m >> (signal.SIGTERM - 1) & 1 for m in masks) else "default"

def noting():
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: got.append(signum))

def main():
    os.setsid()  # as torchrun starts each rank: a session and process group of its own
    noting()
    expected = [b[0].tolist() for b in plain()]
    print("before", disposition(plain()))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what a forked child gets back below
    guard = Guard(daemon=False, force_exit=False)
    print("guarded", signalled(plain(), signal.SIGTERM, signal.SIGINT) == expected)
    print("persistent", signalled(plain(persistent=True), signal.SIGTERM) == expected)
    print("stop", guard.stop_requested)
    print("guarded-workers", disposition(plain()))
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    child.start()  # another child, not a loader's worker: SIGTERM's default (Pool.terminate relies on it)
    time.sleep(0.5)
    child.terminate()
    child.join(10)
    print("child", child.exitcode)
    guard.close()
    noting()
    print("after", disposition(plain()))
    Guard(daemon=False, force_exit=False)  # guarded again, and left so: the process ends with it
    global KEPT
    KEPT = iter(plain(persistent=True))  # referenced at exit: torch never shuts its workers down
    next(KEPT)

if __name__ == "__main__":
    main()
"""


def test_plain_loaders_outlive_stop_signals_while_a_guard_lives_and_only_then(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]  # no hang at exit
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines == {"before": "default", "guarded": "True", "persistent": "True", "stop": "True",
                     "guarded-workers": "ignored", "child": str(-signal.SIGTERM), "after": "default"}, done.stdout + done.stderr[-3000:]


EARLY_JOB = """
import multiprocessing, multiprocessing.util, os, signal, time
import torch
from spotguard.guard import Guard

class Early:
    # multiprocessing runs its after-fork callbacks in every forked child before the child's target,
    # so before torch's worker loop ignores the stop signals: the window where torchrun's killpg
    # finds a loader worker that is starting (each epoch, without persistent workers)
    on = False

EARLY = Early()
multiprocessing.util.register_after_fork(EARLY, lambda early: early.on and os.kill(os.getpid(), signal.SIGTERM))

def epochs(n=3):
    data = torch.utils.data.TensorDataset(torch.arange(24.0).view(-1, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context="fork")
    try:
        return [b[0].tolist() for _ in range(n) for b in loader]
    except RuntimeError as exc:  # torch: "DataLoader worker (pid(s) ...) exited unexpectedly"
        return "died" if "DataLoader worker" in str(exc) else repr(exc)

def main():
    os.setsid()  # as torchrun starts each rank
    expected = epochs()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what a forked child gets back below
    guard = Guard(daemon=False, force_exit=False)
    EARLY.on = True  # from here, every forked child is SIGTERMed as it starts
    drawn = epochs()
    print("workers", drawn == expected or drawn)
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    child.start()  # not a loader's worker: dies of the early SIGTERM as without spotguard
    child.join(10)
    print("child", child.exitcode)
    EARLY.on = False
    with multiprocessing.get_context("fork").Pool(1) as pool:
        pool.apply_async(time.sleep, (30,))
        time.sleep(0.5)
        workers = list(pool._pool)
        pool.terminate()  # SIGTERMs its busy worker: the Pool's workers keep SIGTERM's default
    print("pool", [w.exitcode for w in workers])
    print("stop", guard.stop_requested)  # the workers' SIGTERMs were theirs alone
    guard.close()

if __name__ == "__main__":
    main()
"""


def test_loader_workers_ignore_a_stop_signal_that_comes_while_they_start(tmp_path):
    """A SIGTERM that reaches a plain loader's worker between its fork and torch's worker loop (a
    preemption while an epoch's workers start) is held from the fork on and dropped once the worker
    ignores it: the loop gets every batch. Other forked children (a Process, a Pool's workers) still
    die of SIGTERM, early or late."""
    lines, said = _job_lines(tmp_path / "early.py", EARLY_JOB, timeout=120)
    assert lines == {"workers": "True", "child": str(-signal.SIGTERM), "pool": f"[{-signal.SIGTERM}]",
                     "stop": "False"}, said


SERVED_JOB = """
import multiprocessing, os, signal, time
import torch
from spotguard.data import ignore_stop_signals

class Starting(torch.utils.data.Dataset):
    # Unpickled in each forkserver worker before its target runs: the window where torchrun's killpg,
    # Ctrl-C or scancel finds a worker that is starting (seconds under load, each epoch).
    def __init__(self):
        self.kill = False

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([float(i)])

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.kill:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)

def epochs(data, n=2):
    loader = ignore_stop_signals(torch.utils.data.DataLoader(data, batch_size=4, num_workers=2,
                                                             multiprocessing_context="forkserver"))
    try:
        return [b.view(-1).tolist() for _ in range(n) for b in loader]
    except RuntimeError as exc:  # torch: "DataLoader worker (pid(s) ...) exited unexpectedly"
        return "died" if "DataLoader worker" in str(exc) else repr(exc)

def main():
    data = Starting()
    expected = epochs(data)
    data.kill = True
    drawn = epochs(data)
    print("workers", drawn == expected or drawn)
    child = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(30,))
    child.start()  # not a loader's worker: SIGTERM's default, as without spotguard
    time.sleep(1)
    child.terminate()
    child.join(30)
    print("child", child.exitcode)

if __name__ == "__main__":
    main()
"""


def test_forkserver_loader_workers_ignore_a_stop_signal_that_comes_while_they_start(tmp_path):
    """spotguard's forkserver (the one a loader gets where forking can hang, or that a user's
    ``multiprocessing_context='forkserver'`` loader given to spotguard starts) hands its children
    SIGTERM and SIGINT ignored: a loader worker reached by both while it unpickles its dataset lives
    and the loop gets every batch; another forkserver child still ends at ``terminate()``."""
    lines, said = _job_lines(tmp_path / "served.py", SERVED_JOB, timeout=240)
    assert lines == {"workers": "True", "child": str(-signal.SIGTERM)}, said


def _job_lines(script, source: str, timeout: int, **env: str) -> tuple[dict[str, str], str]:
    """Run ``source`` as a script of its own (``env`` added to the environment); its ``name value``
    lines, and what it said (for a message)."""
    script.write_text(source)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout,
                          check=False, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines()), done.stdout + done.stderr[-3000:]


PRELOADED_JOB = """
import os
import torch
import imported_once  # noqa: F401  (a library the script holds, as a Lightning script holds lightning)
from spotguard.data import ignore_stop_signals

class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([float(i)])

if __name__ == "__main__":
    loader = ignore_stop_signals(torch.utils.data.DataLoader(Data(), batch_size=4, num_workers=2,
                                                             multiprocessing_context="forkserver"))
    batches = [b.view(-1).tolist() for _ in range(3) for b in loader]
    print("batches", len(batches))
    with open(os.environ["IMPORTS"]) as imports:
        print("importers", len(set(imports.read().split())))
"""


def test_a_forkserver_loader_given_to_spotguard_has_the_scripts_modules_preloaded(tmp_path):
    """The server that ``ignore_stop_signals`` starts preloads what the main script holds, so an
    epoch's workers do not import it again (a Lightning script's workers imported lightning every
    epoch: seconds, under load more than a notice's deadline). Counted by the processes that ran
    the module's top level: the job and the server, not the 6 workers of 3 epochs."""
    library = tmp_path / "site"  # installed, as lightning is: on the path of every process
    library.mkdir()
    (library / "imported_once.py").write_text(
        "import os\nwith open(os.environ['IMPORTS'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n")
    lines, said = _job_lines(tmp_path / "preloaded.py", PRELOADED_JOB, timeout=240, IMPORTS=str(tmp_path / "imports.txt"),
                             PYTHONPATH=os.pathsep.join([str(library), os.environ.get("PYTHONPATH", "")]))
    assert lines == {"batches": "12", "importers": "2"}, said
