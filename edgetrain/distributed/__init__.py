"""Server-side (torch.distributed) versions of the methods: pipelines, launch helpers. Each module is
imported on its own (they pull in torch.distributed), nothing is imported here."""
