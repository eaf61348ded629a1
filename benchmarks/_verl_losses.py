"""verl's `verl/trainer/distillation/fsdp/losses.py` as installed, for bench_verl.py and (loaded by path)
tests/test_integrations_verl.py: the losses flashkd's verl integration is held to."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path


def load_verl_losses():
    """verl's fsdp/losses.py. Importing it through verl's packages pulls in ray and tensordict
    (`verl/__init__`, `verl.workers.config`); where those are absent the file itself is loaded, with
    `verl.workers.config` (whose config classes it names in annotations only) stood in for while it loads.
    Its own imports are real: `verl.utils.ulysses`."""
    try:
        return importlib.import_module("verl.trainer.distillation.fsdp.losses")
    except ImportError:
        pass
    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    saved = {name: sys.modules.get(name) for name in ("verl", "verl.workers", "verl.workers.config")}
    try:
        if not hasattr(sys.modules.get("verl"), "__path__"):
            package = types.ModuleType("verl")
            package.__path__ = [str(root)]
            sys.modules["verl"] = package
        config = types.ModuleType("verl.workers.config")
        config.DistillationConfig = config.DistillationLossConfig = object
        sys.modules["verl.workers"] = types.ModuleType("verl.workers")
        sys.modules["verl.workers.config"] = config
        spec = importlib.util.spec_from_file_location("_verl_fsdp_distillation_losses",
                                                      root / "trainer" / "distillation" / "fsdp" / "losses.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
