"""One module per platform event source; see base.py for the protocol.

* ``base``: the :class:`~.base.Watcher` protocol (one poll, a snapshot of pending notices), errors.
* ``runner``: :class:`~.runner.Runner`, the loop around one watcher (pacing, timeouts, backoff).
* ``detect``: :func:`~.detect.detect_platform` (DMI, never a metadata probe) and
  :func:`~.detect.build_watchers`.
* ``aws``, ``gcp``, ``azure``, ``alibaba``: the cloud watchers; ``slurm``: the job's walltime.
* ``signal``, ``manual``: push sources the daemon core feeds itself.
* ``_common``: what the HTTP watchers share (status handling, metadata tokens, sticky notices).
"""
