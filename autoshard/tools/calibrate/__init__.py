"""``autoshard calibrate``: measure this machine on gloo ranks (``measure.py``) and fit a
device profile to the measurements (``fit.py``, no measuring, testable alone)."""
