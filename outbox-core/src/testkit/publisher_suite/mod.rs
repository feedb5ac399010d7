//! The Publisher conformance suite: the rules of [`Publisher::publish`](crate::Publisher::publish),
//! checked against a real broker.
//!
//! [`run_all`] runs the checks any [`PublisherFixture`] supports; [`run_contract`] runs the whole
//! contract on a [`BrokerFixture`] (bad events fail alone, a failed event holds back its aggregate,
//! the allow-list, bounded destination caches, a broker that is down); [`crate::publisher_contract!`]
//! makes one test of each. Each check is public too.

mod basics;
mod common;
mod destinations;
mod failures;
mod formats;
mod outage;

pub use basics::{
    batch_is_acknowledged_and_received_in_order, check_succeeds, empty_batch_has_no_outcomes,
};
pub use common::{event, RECEIVE_TIMEOUT, RECOVERY_TIMEOUT, SIZE_LIMIT};
pub use destinations::{
    destinations_outside_the_allow_list_are_refused, the_destination_cache_stays_bounded,
};
pub use failures::{a_failed_event_holds_back_its_aggregate, bad_events_fail_alone};
pub use formats::{messages_in_each_format_are_read_by_a_cloudevents_library, CLOUDEVENTS_SOURCE};
pub use outage::{a_broker_that_is_down_fails_retryably_then_recovers, broker_down};

use super::{BrokerFixture, PublisherFixture};

/// Runs every check of the suite against one fixture, in order (each check expects what the
/// previous ones published to be received).
pub async fn run_all(fx: &dyn PublisherFixture) {
    let mut seen = 0;
    empty_batch_has_no_outcomes(fx).await;
    check_succeeds(fx).await;
    seen += batch_is_acknowledged_and_received_in_order(fx, seen).await;
    let _ = seen;
}

/// Runs the whole publisher contract against a broker fixture: [`run_all`], then every check of a
/// [`BrokerFixture`], in order.
pub async fn run_contract(fx: &dyn BrokerFixture) {
    run_all(fx).await;
    bad_events_fail_alone(fx).await;
    a_failed_event_holds_back_its_aggregate(fx).await;
    destinations_outside_the_allow_list_are_refused(fx).await;
    the_destination_cache_stays_bounded(fx).await;
    messages_in_each_format_are_read_by_a_cloudevents_library(fx).await;
    broker_down(fx).await;
}

/// One test per rule of the publisher contract ([`run_contract`]), each on a fixture of its own:
/// `publisher_contract!(Fixture::new().await);` in an adapter's test file, with `tokio` among its
/// dev-dependencies. The expression is evaluated in each test.
#[macro_export]
macro_rules! publisher_contract {
    ($fixture:expr) => {
        mod publisher_contract {
            #[allow(unused_imports)]
            use super::*;
            use $crate::testkit::{publisher_suite as suite, BrokerFixture};

            $crate::publisher_contract!(@test $fixture, acknowledges_in_order_and_carries_the_event, suite::run_all);
            $crate::publisher_contract!(@test $fixture, bad_events_fail_alone, suite::bad_events_fail_alone);
            $crate::publisher_contract!(@test $fixture, a_failed_event_holds_back_its_aggregate, suite::a_failed_event_holds_back_its_aggregate);
            $crate::publisher_contract!(@test $fixture, destinations_outside_the_allow_list_are_refused, suite::destinations_outside_the_allow_list_are_refused);
            $crate::publisher_contract!(@test $fixture, the_destination_cache_stays_bounded, suite::the_destination_cache_stays_bounded);
            $crate::publisher_contract!(@test $fixture, messages_in_each_format_are_read_by_a_cloudevents_library, suite::messages_in_each_format_are_read_by_a_cloudevents_library);
            $crate::publisher_contract!(@test $fixture, a_broker_that_is_down_fails_retryably_then_recovers, suite::broker_down);
        }
    };
    (@test $fixture:expr, $name:ident, $check:path) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let fx = $fixture;
            $check(&fx).await;
            fx.dispose().await;
        }
    };
}
