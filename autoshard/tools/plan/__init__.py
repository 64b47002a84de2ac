"""``autoshard.plan``: which layout to train with. The search over candidate layouts
(``plan.py``, with merged all-reduces on a mixed cluster), the layouts and their lower bounds (``layouts.py``), what a plan returns
(``result.py``, ``mixed_summary.py``), and on a mixed cluster the batch and state shares
(``shares.py``).

A new planner rule goes here; it reads simulations from :mod:`autoshard.cost`."""
