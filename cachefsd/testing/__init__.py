"""Real servers for tests and benchmarks: a moto S3 server over HTTP and a
GCS emulator. They ship in the package (not under ``tests/``) so benchmarks
and the demo can start the same servers the test suite uses."""
