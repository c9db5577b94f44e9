"""atroposd: one supervised service for Atropos reinforcement-learning jobs."""

__version__ = "0.1.0"
