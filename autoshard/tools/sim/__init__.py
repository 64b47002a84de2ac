"""The step simulator: one training step played from the compiled forward and backward
graphs on the cost model (``simulator.py``), the memory it tracks (``liveness.py``), and
a mixed cluster (``cluster.py``) with each rank type played side by side
(``mixed_cluster.py``). Read by the report and the planner."""
