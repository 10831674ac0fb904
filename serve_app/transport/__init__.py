"""How stage calls travel between replicas: raystream's own port link and shared memory."""
