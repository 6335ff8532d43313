"""Operator fusion: a public rule registry, built-in rules and the ``fusion`` pass.

Register a rule with :func:`register_fusion_rule` or the :func:`fusion_rule`
decorator (see ``core.py`` and docs/fusion.md).  ``graph_level`` (options)
selects what runs: 0 nothing, 1 Cast/Identity cleanups, 2 standard fusions,
3 aggressive fusions that may change rounding (BN folding, attention).
"""
from . import builtin as _builtin
from . import cleanups as _cleanups
from .core import (RULES, Builder, FusionRule, FusionRuleError, Skip, fusion_rule,
                   register_fusion_rule, unregister_fusion_rule)

if not any(r.builtin for r in RULES.values()):
    _builtin.register_norms()  # (first: see register_norms)
    _cleanups.register()
    _builtin.register()

from . import fusion_pass  # noqa: E402,F401  (registers the "fusion" pass)

__all__ = ["register_fusion_rule", "fusion_rule", "unregister_fusion_rule", "RULES", "FusionRule",
           "FusionRuleError", "Builder", "Skip"]
