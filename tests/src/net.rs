//! Network faults on loopback connections, with iptables rules on the `lo` interface's INPUT chain:
//! a connection cut without a reset, or a port's connections reset. Each rule carries the comment
//! [`RULE_COMMENT`] and goes when its guard is dropped; `scripts/test-env.sh` removes any a killed
//! test run left behind. Needs root and iptables (`scripts/test-env.sh` installs iptables).

use std::process::{Command, Output};

/// The comment on every rule these guards add.
pub const RULE_COMMENT: &str = "outbox-test";

/// Rules in force while this guard lives.
pub struct NetFault {
    rules: Vec<Vec<String>>,
    port: u16,
}

fn iptables(action: &str, rule: &[String]) -> std::io::Result<Output> {
    Command::new("iptables")
        .args([action, "INPUT", "-i", "lo", "-p", "tcp"])
        .args(rule)
        .args(["-m", "comment", "--comment", RULE_COMMENT])
        .output()
}

impl NetFault {
    fn add(port: u16, rules: Vec<Vec<String>>) -> NetFault {
        let mut added = NetFault {
            rules: Vec::new(),
            port,
        };
        for rule in rules {
            let out = iptables("-I", &rule).unwrap_or_else(|e| {
                panic!("this test needs iptables and root (scripts/test-env.sh installs iptables): {e}")
            });
            assert!(
                out.status.success(),
                "iptables refused {rule:?} (this test needs root and netfilter): {}",
                String::from_utf8_lossy(&out.stderr)
            );
            added.rules.push(rule);
        }
        added
    }

    /// Drops every packet of the loopback connection whose one end is `port`, both ways, with no
    /// reset: as a network cut, a vanished host or a dead NAT entry does.
    pub fn blackhole(port: u16) -> NetFault {
        let rule = |dir: &str| -> Vec<String> {
            [dir, &port.to_string(), "-j", "DROP"]
                .iter()
                .map(|s| s.to_string())
                .collect()
        };
        NetFault::add(port, vec![rule("--sport"), rule("--dport")])
    }

    /// Answers every packet sent to `port` with a reset: its open connections break mid-stream and
    /// new ones are refused, as when a broker's process dies or a proxy drops its connections.
    pub fn reset(port: u16) -> NetFault {
        let rule: Vec<String> = [
            "--dport",
            &port.to_string(),
            "-j",
            "REJECT",
            "--reject-with",
            "tcp-reset",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        NetFault::add(port, vec![rule])
    }
}

impl NetFault {
    /// How many packets this guard's rules have matched so far (that the fault hit something).
    pub fn hits(&self) -> u64 {
        let listed = Command::new("iptables")
            .args(["-L", "INPUT", "-v", "-x", "-n"])
            .output()
            .map(|o| o.stdout)
            .unwrap_or_default();
        let ports = [format!("dpt:{}", self.port), format!("spt:{}", self.port)];
        String::from_utf8_lossy(&listed)
            .lines()
            .filter(|l| {
                l.contains(RULE_COMMENT)
                    && l.split_whitespace().any(|w| ports.iter().any(|p| p == w))
            })
            .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    }
}

impl Drop for NetFault {
    fn drop(&mut self) {
        // Never a panic here: this may run while the test panics.
        for rule in &self.rules {
            if !iptables("-D", rule).is_ok_and(|o| o.status.success()) {
                eprintln!("could not remove the iptables rule {rule:?}");
            }
        }
    }
}
