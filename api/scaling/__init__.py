"""Replicas that scale to zero and back: the API holds a request for a base with no replica while a launcher
starts one, stops a base's replicas once it has been idle for ``LORAPLEX_REPLICA_IDLE_TTL``, and exports the
demand (``api.metrics``) that an autoscaler such as KEDA scales server Deployments on.

- ``demand``: what one API process sees of each base (requests in flight and held, tokens delivered) and the
  replica count that load wants.
- ``launchers``: the one small interface that starts and stops replicas, and which one the settings pick;
  ``local`` (server processes beside the API, what ``loraplex up --replica-idle-ttl`` uses) and
  ``kubernetes`` (a server Deployment's scale, through the official client) implement it.
- ``scaler``: holding requests through a cold start, and the idle watch.
"""
