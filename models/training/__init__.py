"""relserve.models.training: the shared resumable loop and the trainers of the default models.

Training needs packages that serving does not: they are the ``train`` extra (``pip install 'relserve[train]'``,
pinned in pyproject.toml and constraints.txt). :func:`require_train_extra` checks for them when a trainer starts,
so a missing one is named at once, not hours later at the first evaluation.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

__all__ = ["TRAIN_EXTRA_INSTALL", "require_train_extra"]

TRAIN_EXTRA_INSTALL = "pip install 'relserve[train]'  (from a checkout: pip install -c constraints.txt '.[train]')"


def require_train_extra(prog: str, modules: Sequence[str]) -> None:
    """Check that the import packages ``modules`` (from the ``train`` extra) can be imported, without
    importing them.

    Raises:
        SystemExit: with a message naming ``prog``, the missing packages and the extra to install (exit 1).
    """
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"{prog}: {', '.join(missing)} not installed; training needs the train extra: "
                         f"{TRAIN_EXTRA_INSTALL}")
