"""The trajectory API child (`atroposd api`): wire-compatible with atroposlib's run-api, bounded,
validated, durable. It never imports torch, transformers or vllm.

  schema.py    request parsing and validation (the group's schema: atroposd/groups.py, shared with the trainer)
  fastparse.py ScoredData bodies straight into numpy rows (simdjson), same checks as schema.py
  bodies.py    bounded gzip inflation, JSON, the groups of a body (fast path, else the full one)
  batching.py  run-api's batch formation, on group sizes
  queue.py     TrajectoryStore: registrations, queue, buffers, formed batches, room (backpressure)
  spool.py     the append-only spool: replay after a restart, acknowledgements, compaction
  server.py    the aiohttp routes
  settings.py  ApiSettings: the [api] section after flags
  httpio.py    JSON responses, gzip, the guard's checks of a request
  metrics.py   the API's Prometheus metrics
  peers.py     the pid of a registering process, from /proc
  binary.py    binary batches: the safetensors layout of a batch (numpy only), encode / decode
  shmbatch.py  batches through shared-memory segments: acknowledgement, expiry, clean-up
  app.py       the process: replay, bind, serve until SIGTERM
  cli.py       flags and config
"""
