"""The ddp plan's decisions by concern: mixins of `DdpPlan` (codemods/ddp_plan.py, which rules
import). Each module says what it decides and what it takes from the others; none imports
ddp_plan.py."""

# The fsdp migration's own rule (codemods/sharding.py): fixed in a pass, the ddp rules and this
# plan shard the trained models (FSDP2) where they would wrap them in DDP.
FSDP_CODE = "GM415"


def sharding(ctx) -> bool:
    """The fsdp migration: trained models are sharded with `shard_model`, not DDP-wrapped."""
    return FSDP_CODE in ctx.fixing
