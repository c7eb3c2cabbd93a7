#!/usr/bin/env bash
# Shared helpers of up.sh and down.sh.

# Zombie-aware liveness: PID 1 in the CI container reaps orphans lazily, so a
# daemon that already exited can linger as a zombie that `kill -0` still sees.
alive() {
    local s
    s=$(sed -n 's/^[0-9]* (.*) \([A-Za-z]\) .*/\1/p' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $s && $s != Z ]]
}
live_pids() { # exact process name -> live pids
    local p
    for p in $(pgrep -x "$1"); do alive "$p" && echo "$p"; done
    return 0
}
