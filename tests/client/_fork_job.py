"""A resumable job whose loader starts 2 workers every other step, while spotguard's threads and
native threads that attach to the interpreter (ctypes callbacks, as C++ code calling back into Python
does) run: the conditions of CPython gh-112275. For tests/client/test_fork_safety.py.

    python tests/client/_fork_job.py CKPT STEPS
"""

from __future__ import annotations

import ctypes
import sys
import threading

import torch

import spotguard

_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


@_CALLBACK
def _attach(_: object) -> None:  # runs in a fresh native thread: PyGILState_Ensure, a new thread state
    return None


def native_churn(stop: threading.Event) -> None:
    libc = ctypes.CDLL(None)
    libc.pthread_create.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, _CALLBACK, ctypes.c_void_p]
    tid = ctypes.c_ulong()
    while not stop.is_set():
        if libc.pthread_create(ctypes.byref(tid), None, _attach, None) == 0:
            libc.pthread_join(tid, None)


class Items(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), float(i))


def main() -> None:
    root, steps = sys.argv[1], int(sys.argv[2])
    stop = threading.Event()
    threading.Thread(target=native_churn, args=(stop,), daemon=True).start()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = spotguard.DataLoader(Items(), batch_size=4, shuffle=True, num_workers=2, seed=0)
    run = spotguard.Run(root, model=model, optimizer=opt, loader=loader, daemon=False, save_every=4,
                        job_id="fork-job")

    def batches():
        while True:
            yield from loader  # 2 batches per epoch: fresh workers every other step
            loader.sampler.set_epoch(loader.sampler.epoch + 1)

    with run:
        for step, x in zip(run.steps(steps), batches()):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    stop.set()
    context = loader.multiprocessing_context
    print("start method", context.get_start_method() if context else "fork", "step", run.step, flush=True)


if __name__ == "__main__":
    main()
