"""The public surface of `import spotguard`: explicit, complete, and light to import."""

from __future__ import annotations

import subprocess
import sys

import spotguard


def test_every_name_in_all_resolves():
    for name in spotguard.__all__:
        assert getattr(spotguard, name) is not None, name


def test_all_lists_every_public_name_and_nothing_private():
    public = {n for n in dir(spotguard) if not n.startswith("_")}
    modules = {"annotations", "importlib", "TYPE_CHECKING", "Any"}
    submodules = {"cadence", "exit_codes", "guard", "protocol", "sampler", "checkpoint", "run",
                  "storage", "distributed", "integrations", "data"}
    assert public - modules - submodules == set(spotguard.__all__) - {"__version__"}


def test_the_easy_path_names_come_from_their_modules():
    from spotguard.checkpoint import Checkpointer
    from spotguard.run import Run

    assert spotguard.Run is Run and spotguard.Checkpointer is Checkpointer
    assert spotguard.EXIT_PREEMPTED == 75 and spotguard.EXIT_FORCED == 76


def test_import_stays_light_until_a_torch_name_is_used():
    code = ("import sys, spotguard\n"
            "heavy = {'torch', 'numpy', 'httpx', 'prometheus_client', 'pydantic_settings', 'click',\n"
            "         'boto3', 'google.cloud.storage', 'azure.storage.blob', 'spotguard_daemon'}\n"
            "light = not (heavy & set(sys.modules))\n"
            "spotguard.Run\n"
            "print(light, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
