"""Choosing an inference server replica: heartbeats read from Redis, rendezvous hashing with spill-over."""
