"""A training job with an evaluation inside its loop body, written the docs' way.

    python _eval_notice_job.py --ckpt-dir DIR --steps 12 --eval-every 4 --eval-batches 100
        [--heartbeat] [--abandon] [--slow-load S] [--slow-first S]

The evaluation consumes RNG (dropout in train mode, ``torch.rand``) and prints ``eval <step>`` when it
starts; ``--heartbeat`` calls ``run.heartbeat()`` per evaluation batch, ``--abandon`` passes
``abandon_between_steps=True``. ``--slow-load`` makes loading the checkpoint take that long (a slow
restore), ``--slow-first`` the first step's forward (a compilation); each prints ``loading`` or
``first`` first. At the end the job prints ``digest <sha256>`` of the model, optimizer and RNG state.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch
from torch import nn

import spotguard


class SlowLoad:
    """A state entry whose load takes ``seconds`` (a large restore)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def state_dict(self) -> dict:
        return {"n": 1}

    def load_state_dict(self, state: dict) -> None:
        if self.seconds:
            print("loading", flush=True)
            time.sleep(self.seconds)


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for t in list(model.state_dict().values()) + [torch.get_rng_state()]:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for s in optimizer.state.values():
        for v in s.values():
            h.update(repr(v.tolist() if torch.is_tensor(v) else v).encode())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-batches", type=int, default=100)
    p.add_argument("--heartbeat", action="store_true")
    p.add_argument("--abandon", action="store_true")
    p.add_argument("--slow-load", type=float, default=0.0)
    p.add_argument("--slow-first", type=float, default=0.0)
    a = p.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = spotguard.DataLoader(data, batch_size=4, shuffle=True, seed=0)
    state = {"slow": SlowLoad(a.slow_load)}
    run = spotguard.Run(a.ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader,
                        state=state, save_every=5, daemon=False, job_id="eval-notice", abandon_between_steps=a.abandon)

    def batches():
        while True:
            yield from loader
            loader.sampler.set_epoch(loader.sampler.epoch + 1)

    with run:
        for step, (x, y) in zip(run.steps(a.steps), batches()):
            if step == run.start_step:
                print(f"start {step}", flush=True)
            if a.slow_first and step == run.start_step:
                print("first", flush=True)
                time.sleep(a.slow_first)
            model.train()
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if (step + 1) % a.eval_every == 0:
                print(f"eval {step}", flush=True)
                with torch.no_grad():  # dropout stays on: the evaluation draws from torch's RNG
                    for _ in range(a.eval_batches):
                        model(torch.rand(16, 8))
                        time.sleep(0.01)
                        if a.heartbeat:
                            run.heartbeat()
                print(f"evaluated {step}", flush=True)
    print("digest", digest(model, optimizer), flush=True)


if __name__ == "__main__":
    main()
