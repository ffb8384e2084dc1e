"""Integrations with serving stacks: LMCache (serde and storage), SGLang (HiCache storage),
transformers (cache classes live in `weightszip.hf`). Each module imports its framework only when
used; `kvserde` holds the framework-free byte format they share."""
