"""Optional extras, imported where they are used and never at `import fasttrain`.

    diffusers = optional.diffusers()     # or a one-line MissingDependency naming the extra

`import diffusers` costs seconds (it pulls in torch._dynamo and, for its models, scipy.stats), so the
VAE (vae.py), the diffusers backbones (models/diffusers_backbone.py) and the export (export/dispatch.py) import
it through here, on first use. Its logging is turned down to errors: loading a local folder without
`accelerate` warns on every call, and fasttrain passes `low_cpu_mem_usage=False` anyway.
"""
from __future__ import annotations

from .errors import MissingDependency

EXTRA = "pip install 'fasttrain[diffusers]'"


def diffusers(what: str = "this"):
    """The `diffusers` module, or a MissingDependency saying which request needed it."""
    try:
        import diffusers as module
    except ImportError as e:
        if e.name not in (None, "diffusers") and not str(e.name).startswith(("diffusers.", "huggingface_hub")):
            raise  # diffusers is there but broken: a traceback, not a hint to install it
        raise MissingDependency(f"{what} needs the optional package diffusers ({EXTRA})") from None
    from diffusers.utils import logging

    logging.set_verbosity_error()
    return module


def webdataset(what: str = "this"):
    """The `webdataset` module (tar shards: data/shards.py), or a MissingDependency naming the extra."""
    try:
        import webdataset as module
    except ImportError as e:
        if e.name not in (None, "webdataset", "braceexpand"):
            raise
        raise MissingDependency(f"{what} needs the optional package webdataset (pip install "
                                f"'fasttrain[webdataset]')") from None
    return module
