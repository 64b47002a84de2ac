"""What people run around training: ``explain`` (the pipeline on fake ranks), the report, the
step simulator, calibration of a device profile, the multi-rank launcher and the CLI.

Depends on everything below; nothing in ``runtime``, ``passes`` or ``compiler`` imports it."""
