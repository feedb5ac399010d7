//! Policies are data: the retry policy and the ordering policy, plain structs with documented defaults.
//! Only the relay applies them.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// How failed publishes are retried.
///
/// The delay after the n-th failed attempt is `initial_backoff * multiplier^(n-1)`, capped at
/// `max_backoff`, then spread by `jitter` (a fraction: 0.2 means +/-20%) so that events failing
/// together do not come back together. An event whose attempts reach `max_attempts`, or whose error
/// is permanent, is dead-lettered with its last error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub struct RetryPolicy {
    /// Attempts before an event is dead-lettered, the first included. Default 10.
    pub max_attempts: u32,
    /// Delay after the first failed attempt. Default 1 s.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "crate::duration::serde_str")]
    pub initial_backoff: Duration,
    /// Upper bound of the delay. Default 5 min.
    #[cfg_attr(feature = "schema", schemars(with = "String", extend("format" = "duration")))]
    #[serde(with = "crate::duration::serde_str")]
    pub max_backoff: Duration,
    /// Growth factor between attempts. Default 2.0.
    pub multiplier: f64,
    /// Random spread of each delay, as a fraction in `[0, 1]`. Default 0.2.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 10,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
            multiplier: 2.0,
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// Checks the values.
    ///
    /// # Errors
    /// A config error naming the field when a value is out of range.
    pub fn validate(&self) -> Result<(), Error> {
        if self.max_attempts == 0 {
            return Err(Error::config(
                "retry.max_attempts = 0: expected at least 1 (the first attempt counts)",
            ));
        }
        if !(self.multiplier.is_finite() && self.multiplier >= 1.0) {
            return Err(Error::config(format!(
                "retry.multiplier = {}: expected a number >= 1.0",
                self.multiplier
            )));
        }
        if !(self.jitter.is_finite() && (0.0..=1.0).contains(&self.jitter)) {
            return Err(Error::config(format!(
                "retry.jitter = {}: expected a fraction between 0.0 and 1.0",
                self.jitter
            )));
        }
        if self.max_backoff < self.initial_backoff {
            return Err(Error::config(format!(
                "retry.max_backoff = {:?} is below retry.initial_backoff = {:?}: expected max >= initial",
                self.max_backoff, self.initial_backoff
            )));
        }
        Ok(())
    }

    /// The delay before the next attempt, after `failed_attempts` attempts failed (1 after the first).
    pub fn backoff(&self, failed_attempts: u32) -> Duration {
        let exp = failed_attempts.saturating_sub(1).min(64) as i32;
        let base = self.initial_backoff.as_secs_f64() * self.multiplier.powi(exp);
        let capped = base.min(self.max_backoff.as_secs_f64());
        let spread = if self.jitter > 0.0 {
            1.0 + self.jitter * (2.0 * fastrand::f64() - 1.0)
        } else {
            1.0
        };
        let secs = (capped * spread).clamp(0.0, self.max_backoff.as_secs_f64());
        Duration::from_secs_f64(secs)
    }

    /// True when an event that has now failed `failed_attempts` times may be tried again.
    pub fn may_retry(&self, failed_attempts: u32) -> bool {
        failed_attempts < self.max_attempts
    }
}

/// Which events may be published side by side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum OrderingPolicy {
    /// Events of one aggregate are published in insertion order, across any number of relays: an event
    /// is claimed only when every earlier event of its aggregate is done, and a failure holds back the
    /// later events of that aggregate (and only of that aggregate). The default.
    #[default]
    PerAggregate,
    /// No ordering: any pending event may be claimed and published at any time, for raw throughput.
    Unordered,
}

impl OrderingPolicy {
    /// The configuration name (`per_aggregate` or `unordered`).
    pub fn as_str(self) -> &'static str {
        match self {
            OrderingPolicy::PerAggregate => "per_aggregate",
            OrderingPolicy::Unordered => "unordered",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_caps_without_jitter() {
        let p = RetryPolicy {
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            jitter: 0.0,
            ..RetryPolicy::default()
        };
        assert_eq!(p.backoff(1), Duration::from_millis(100));
        assert_eq!(p.backoff(2), Duration::from_millis(200));
        assert_eq!(p.backoff(3), Duration::from_millis(400));
        assert_eq!(p.backoff(5), Duration::from_secs(1));
        assert_eq!(p.backoff(1000), Duration::from_secs(1));
    }

    #[test]
    fn jitter_stays_within_bounds() {
        let p = RetryPolicy {
            initial_backoff: Duration::from_secs(10),
            max_backoff: Duration::from_secs(100),
            jitter: 0.5,
            ..RetryPolicy::default()
        };
        let mut distinct = std::collections::HashSet::new();
        for _ in 0..200 {
            let d = p.backoff(1);
            assert!(
                d >= Duration::from_secs(5) && d <= Duration::from_secs(15),
                "{d:?}"
            );
            distinct.insert(d.as_millis());
        }
        assert!(distinct.len() > 10, "jitter must spread delays");
    }

    #[test]
    fn attempts_limit() {
        let p = RetryPolicy {
            max_attempts: 3,
            ..RetryPolicy::default()
        };
        assert!(p.may_retry(1));
        assert!(p.may_retry(2));
        assert!(!p.may_retry(3));
    }

    #[test]
    fn validation_names_the_key() {
        let p = RetryPolicy {
            max_attempts: 0,
            ..RetryPolicy::default()
        };
        assert!(p
            .validate()
            .unwrap_err()
            .message()
            .contains("retry.max_attempts"));
        let p = RetryPolicy {
            jitter: 1.5,
            ..RetryPolicy::default()
        };
        assert!(p.validate().unwrap_err().message().contains("retry.jitter"));
        let p = RetryPolicy {
            initial_backoff: Duration::from_secs(10),
            max_backoff: Duration::from_secs(1),
            ..RetryPolicy::default()
        };
        assert!(p
            .validate()
            .unwrap_err()
            .message()
            .contains("retry.max_backoff"));
        RetryPolicy::default().validate().unwrap();
    }

    #[test]
    fn ordering_names() {
        let o: OrderingPolicy = serde_json::from_str("\"unordered\"").unwrap();
        assert_eq!(o, OrderingPolicy::Unordered);
        assert_eq!(OrderingPolicy::default().as_str(), "per_aggregate");
    }
}
