"""What a step costs, predicted from its graphs: the device profiles (``profiles.py``) and the
cost model pricing each op and collective on them (``cost_model.py``); the step simulator that
plays the compiled forward and backward on that model (``simulator.py``), the memory it tracks
(``liveness.py``) and what fusing memory-bound ops saves (``fusion.py``); a mixed cluster
(``cluster.py``) with each rank type played side by side (``mixed_cluster.py``).

Depends on ``runtime`` and ``passes``; provides prices and simulations to the compiler (which
schedules and buckets by them) and to the tools (report, planner, calibration). Nothing in
``runtime`` or ``passes`` imports it."""
