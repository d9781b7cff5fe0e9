"""The role layout of a module's delayed-scaling state (docs/design.md, section 2): the one place
that says which column of an amax group's storage holds which tensor of which GEMM."""

__all__ = [
    "FWD_ROLES", "BWD_ROLES", "INPUT", "WEIGHT", "OUTPUT", "GRAD_OUTPUT", "GRAD_INPUT",
    "FWD_ROLE_NAMES", "BWD_ROLE_NAMES", "forward_column", "backward_column",
]  # fmt: skip

FWD_ROLES = 3  # per GEMM, in the forward direction: input, weight, output
BWD_ROLES = 2  # per GEMM, in the backward direction: grad_output, grad_input
INPUT, WEIGHT, OUTPUT = 0, 1, 2
GRAD_OUTPUT, GRAD_INPUT = 0, 1
# the roles that are cast (and so have amaxes and scales that mean something): output and grad_input
# are TransformerEngine's layout, never cast here, their amaxes stay 0
FWD_ROLE_NAMES = {INPUT: "input", WEIGHT: "weight"}
BWD_ROLE_NAMES = {GRAD_OUTPUT: "grad_output"}


def forward_column(offset: int, gemm_index: int, role: int) -> int:
    """The storage column of forward `role` of GEMM `gemm_index` of a module whose first column is
    `offset`."""
    return offset + FWD_ROLES * gemm_index + role


def backward_column(offset: int, gemm_index: int, role: int) -> int:
    return offset + BWD_ROLES * gemm_index + role
