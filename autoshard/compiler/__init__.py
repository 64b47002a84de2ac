"""The ``torch.compile`` backend: options, the declared pass pipeline (whose passes live in
``autoshard.passes``), the ranks' plan check and graph dumps. The cost model that guides the
passes lives a floor below, in ``autoshard.cost``.

Depends on ``runtime``, ``passes`` and ``cost``; nothing below it imports it."""
