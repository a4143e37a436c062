"""embedfleet data plane: the embedding server that runs in each pod."""
