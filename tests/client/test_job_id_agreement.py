"""One job id per job (issue 24, item 0), under real ``torchrun`` (2 ranks, gloo, CPU).

Each rank plays a node of its own: it launches the identical command from its own working directory
(nodes rarely share one), so each derives another id from :func:`spotguard._jobid.derive`. Every rank
must use rank 0's; ranks *given* different ids are refused at start, in one line, on every rank.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from _example import isolated_env

pytestmark = pytest.mark.slow

JOB = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import spotguard

    def say(line):  # one write per line: the two ranks share the pipe, and print() writes twice
        os.write(1, (line + "\\n").encode())

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    home = os.path.join(sys.argv[1], f"node-{rank}")
    os.makedirs(home, exist_ok=True)
    os.chdir(home)  # each "node" launches from its own directory
    for case, given in [("none", ""), ("same", "exp-7"), ("different", f"exp-{rank}")]:
        try:
            run = spotguard.Run(os.path.join(home, case), model=torch.nn.Linear(2, 2), daemon=False,
                                job_id=given)
        except ValueError as exc:
            say(f"{case}: rank {rank} refused: {exc}")
            continue
        say(f"{case}: rank {rank} derived {spotguard._jobid.derive()} uses {run.job_id}")
        run.close()
    dist.destroy_process_group()
""")


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> str:
    """One torchrun launch (2 ranks) plays the three cases in turn."""
    home = tmp_path_factory.mktemp("job-id")
    script = home / "train.py"
    script.write_text(JOB)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(script), str(home)]
    done = subprocess.run(argv, env=isolated_env(home / "rt"), timeout=120, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.returncode == 0, done.stdout
    return done.stdout


def uses(out: str, case: str) -> list[tuple[str, str, str]]:
    return re.findall(rf"^{case}: rank (\d) derived (\S+) uses (\S+)$", out, re.M)


def test_ranks_that_derive_different_ids_all_use_rank_0s(output):
    derived = {rank: own for rank, own, _ in uses(output, "none")}
    used = {rank: chosen for rank, _, chosen in uses(output, "none")}
    assert len(set(derived.values())) == 2, output  # the nodes' own ids differ...
    assert used == {"0": derived["0"], "1": derived["0"]}, output  # ...and both use rank 0's


def test_ranks_given_the_same_id_use_it(output):
    assert [chosen for _, _, chosen in uses(output, "same")] == ["exp-7", "exp-7"], output


def test_ranks_given_different_ids_are_refused_in_one_line_on_every_rank(output):
    refused = re.findall(r"^different: rank (\d) refused: (.*)$", output, re.M)
    assert sorted(rank for rank, _ in refused) == ["0", "1"] and not uses(output, "different"), output
    for _, message in refused:
        assert "'exp-0' on rank 0; 'exp-1' on rank 1" in message and "same job_id=" in message, message
