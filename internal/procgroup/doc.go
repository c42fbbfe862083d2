// Package procgroup owns the two facts about a Unix process group that fenceproxy lock and
// the test servers need to stop one safely: when its leader has exited WITHOUT reaping it,
// and whether any process of the group other than a zombie is left.
//
// Why not reap at once: a process group's id is its leader's pid. Once the leader is reaped
// and the group's last member is gone, the kernel may give that number to any new process,
// and one that makes itself a group leader (a server started with Setpgid, say) would then
// receive the SIGTERM or SIGKILL meant for the old group. A leader that has exited but is
// not reaped is a zombie that keeps its pid, so signals to -pgid reach the old group and
// nothing else until the caller reaps it (exec.Cmd.Wait) after the group is stopped.
package procgroup
