"""``python -m comfyui_mc_sparse ...``: the command-line entry (see ``tools.cli``)."""

import importlib
import sys

if __package__ and "." in __package__:
    from .tools import cli
else:  # run from the checkout root: load the root as a package first, so relative imports resolve
    from . import _standalone

    pack = _standalone.load_pack()
    cli = importlib.import_module(pack.__name__ + ".comfyui_mc_sparse.tools.cli")

sys.exit(cli.main())
