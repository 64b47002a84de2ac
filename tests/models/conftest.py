import os

# Two to four ranks share this machine's cores: Inductor's pool of compile workers per rank
# only adds processes to start (the tier's Inductor test: 107 s with the pool, 83 s without).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# The launcher's fork server imports these once for every launch of this tier (transformers and
# its model classes: about 3 s per rank otherwise).
from autoshard.tools import launch  # noqa: E402

launch.PRELOAD.append("hf_models")
