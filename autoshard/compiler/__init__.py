"""The ``torch.compile`` backend: options, the declared pass pipeline (whose passes live in
``autoshard.passes``), the cost model that guides them, the ranks' plan check and graph dumps.

Depends on ``runtime`` and ``passes``; nothing below it imports it."""
