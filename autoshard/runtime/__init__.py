"""What training calls: parameters become shards, annotation ops mark their uses, gradients
reduce, checkpoints save and load shards, failures reach every rank.

Depends on nothing else in autoshard but ``_compat``; the compiler and tools build on it."""
