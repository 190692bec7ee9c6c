"""spotguard: training jobs that survive spot and preemptible interruptions.

The public surface is listed in ``__all__``; everything else is private.
"""

from spotguard.protocol import Kind, Notice

__version__ = "0.1.0"

__all__ = ["Kind", "Notice", "__version__"]
