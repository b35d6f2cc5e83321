"""The mechanisms the multi-process recipes (edgetrain.recipes: DDP SegProp, the SCPL pipeline, subnetwork
DP) run on: starting torchrun from Python (launch), torch.distributed.elastic's failure records
(elastic_run) and point-to-point tensor transport (p2p). Each module is imported on its own (they pull in
torch.distributed); nothing is imported here."""
