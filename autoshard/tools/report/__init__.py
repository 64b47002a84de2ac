"""What the backend did, for people: :class:`~autoshard.tools.report.report.Report` and
its text summary and Chrome trace (``report.py``), the HTML page (``page.py``) and its
panels (``memory_panel.py``, ``code.py``), what each pass changed (``pass_changes.py``),
and the drawing helpers (``svg.py``); a run measured by
:class:`autoshard.Telemetry`, rank by rank (``run.py``: ``autoshard report RUN``).

A new report panel goes here."""
