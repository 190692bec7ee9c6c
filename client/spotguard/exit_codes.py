"""Exit statuses of a training process that stopped because of an interruption notice.

Launchers decide whether to start the job again from its exit status, so the two outcomes of a
notice get distinctive values that no ordinary crash produces:

``EXIT_PREEMPTED = 75``
    ``EX_TEMPFAIL`` from ``sysexits.h``, "temporary failure, try again". The process stopped cleanly
    after a notice: the newest checkpoint is committed and the daemon was told the process is safe.
    Requeue on it: a Slurm batch script (``[ $? -eq 75 ] && scontrol requeue $SLURM_JOB_ID``),
    Kubernetes (``restartPolicy: OnFailure``, or a ``podFailurePolicy`` rule ``onExitCodes: [75]``),
    torchrun (``--max-restarts``) and systemd (``RestartForceExitStatus=75``) all can.

``EXIT_FORCED = 76``
    The forced-exit watchdog ended the process because the clean stop did not finish before the
    deadline (minus a margin): typically a collective that hangs because a peer is already gone.
    Also a rank of a multi-rank run hung on its own (its loader's live workers produced nothing, or
    its own save did not return, for the stall limit: see :mod:`spotguard._stall`), ended before
    the peers would wait out ``peer_timeout``. The last committed checkpoint is still valid (commits
    are atomic); requeue on it as on 75, but a recurring 76 points at a hang worth investigating.

``EXIT_PEER_LOST = 77``
    Another rank of the job is gone: the ranks' per-step agreement did not complete within
    ``Run(peer_timeout=)``, or no step boundary was reached for that long (a collective of the
    training step itself waiting for a peer on a node that was killed outright). The last
    committed checkpoint is valid; requeue the whole job (every node) as on 75.

``EXIT_INTERRUPTED = 130``
    The shell's status for Ctrl-C (128 + SIGINT). The first SIGINT is a stop with no deadline: the
    step reached at the next boundary is saved and the process exits 130 (not 75: a person asked
    for the stop, nothing should relaunch the job). A second SIGINT aborts at once
    (``KeyboardInterrupt``).
"""

from __future__ import annotations

__all__ = ["EXIT_PREEMPTED", "EXIT_FORCED", "EXIT_PEER_LOST", "EXIT_INTERRUPTED"]

EXIT_PREEMPTED = 75
"""A clean stop after a notice (``EX_TEMPFAIL``): restart the identical command to resume."""

EXIT_FORCED = 76
"""The watchdog forced the exit because the clean stop overran its deadline."""

EXIT_PEER_LOST = 77
"""A peer rank vanished (its node was killed): the job must be relaunched on every node."""

EXIT_INTERRUPTED = 130
