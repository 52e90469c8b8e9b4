"""The OpenAI-compatible HTTP server: request/response models, serving classes and the app."""
