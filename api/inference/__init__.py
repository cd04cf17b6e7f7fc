"""OpenAI-compatible inference through the API: validate, admit, route to a replica, relay, meter."""
