"""The status codes of a pack's members, as the pack's `member_status` variable holds them."""

ACTIVE = 0
FROZEN_NAN = 1
STOPPED_EARLY = 2
FAILED = 3
STATUS_NAMES = {
    ACTIVE: "active",
    FROZEN_NAN: "frozen:nan",
    STOPPED_EARLY: "stopped:early",
    FAILED: "failed",
}
