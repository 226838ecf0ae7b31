"""The ddp plan's decisions by concern: mixins of `DdpPlan` (codemods/ddp_plan.py, which rules
import). Each module says what it decides and what it takes from the others; none imports
ddp_plan.py."""
