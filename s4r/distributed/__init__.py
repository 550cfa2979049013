"""Running one model over several processes or devices: the process group (`world`), tensor parallelism by
KV head (`tensor_parallel`), per-rank cache files (`rank_files`) and layers placed on devices
(`placement`)."""
