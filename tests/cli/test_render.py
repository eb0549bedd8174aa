"""How the terminal shows durations: the dashboard's words, not "7d00h" (issue 11 item 9)."""
import pytest

from gpuswap.cli.render import duration


@pytest.mark.parametrize("seconds,shown", [
    (None, "-"), (4.23, "4.2s"), (45, "45s"), (60, "1m"), (185, "3m 05s"), (3600, "1h"),
    (7800, "2h 10m"), (86400, "1 day"), (97200, "1 day 3h"), (7 * 86400, "7 days"), (7 * 86400 + 59, "7 days"),
])
def test_durations_read_as_the_dashboard_writes_them(seconds, shown):
    assert duration(seconds) == shown
