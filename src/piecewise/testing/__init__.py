"""Fixtures for tests and benchmarks: small models whose attention is a splitting op
(`piecewise.testing.toy`), a graph platform for the CPU with CUDA-graph semantics
(`piecewise.testing.graph_platform`, registered by tests only, never by the library) and a private
Redis server on 127.0.0.1 (`piecewise.testing.redis_server`).

Nothing is imported here, and `import piecewise` does not import this package.
"""
