"""Usage reports: what tenants used (inference, training, residency) and hold (storage), over a period."""
