"""The engines of a ModelPack: fused groups and the graph engine, behind one protocol."""
