"""What people run around training, one room per idea:

- ``report/``: what the backend did, for people (summary, HTML page, trace);
- ``plan/``: ``autoshard.plan``, the layout search and its rules;
- ``calibrate/``: measuring a machine and fitting a device profile to it;
- ``explain.py`` (the pipeline on fake ranks, feeding the report and the planner),
  ``launch.py`` (``run_ranks``), ``cli.py`` (the ``autoshard`` command), ``units.py``
  (bytes and times as printed).

Depends on everything below (the simulator it reads is ``autoshard.cost``); nothing in ``runtime``,
``passes``, ``cost`` or ``compiler`` imports it."""
