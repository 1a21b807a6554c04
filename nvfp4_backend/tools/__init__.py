"""Applications on the core: the nvfp4-backend command (cli), demo, benchmark, fuzzer and capacity table."""
